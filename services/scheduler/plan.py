"""What the policy hands the worker for one step, and what it gets back: plain values.

A `StepPlan` is a list of `SeqStep`s, one per sequence in the step, each naming the request's fixed
parameters (`RequestParams`, built once when the request arrives), its query tokens and KV slots,
and what it wants back. The worker reads nothing else of the policy's state; it answers with one
`SeqResult` per `SeqStep`. (Per-sequence-per-step objects are frozen `msgspec.Struct`s, not
dataclasses: built per sequence per step, where a dataclass's construction cost shows.)
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from contracts.scheduler import LogprobParams, SamplingParams
from services.common.logprob_rows import HostRows
from services.scheduler.request import SchedulerRequest, has_penalties, is_identity

class RequestParams(msgspec.Struct, frozen=True, gc=False):
    """A request's parameters as the worker reads them, fixed for its life."""

    rid: str
    sampling: SamplingParams
    logprobs: LogprobParams
    prompt_ids: np.ndarray  # int32 [P]
    seed: int  # the request's sampling seed, or one the scheduler drew for it
    samples_randomly: bool  # temperature > 0: its tokens are drawn, not the argmax
    processes_logits: bool  # some processor (`logits_processing`) changes its logits
    has_penalties: bool  # those processors read its token history
    # (top-k, requested ids) of its output rows; None where it wants none. Producers with equal
    # keys share one logprob query a step.
    output_logprob_key: tuple[int, tuple[int, ...]] | None
    prompt_logprob_start: int | None  # the first prompt position whose logprob it wants; None: none

    @classmethod
    def of(cls, request: SchedulerRequest, seed: int) -> RequestParams:
        logprobs, sampling = request.logprobs, request.sampling
        wanted = logprobs.return_logprob
        key = (logprobs.top_logprobs_num, logprobs.token_ids_logprob) if wanted else None
        start = logprobs.logprob_start_len if wanted and logprobs.logprob_start_len >= 0 else None
        return cls(request.rid, sampling, logprobs, request.prompt_ids, seed, sampling.temperature > 0,
                   not is_identity(sampling), has_penalties(sampling), key, start)  # fmt: skip

    @property
    def wants_logprobs(self) -> bool:
        return self.output_logprob_key is not None

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)


class SeqStep(msgspec.Struct, frozen=True, gc=False):
    """One sequence's share of a step: query tokens `[start, start + num_query)` of its sequence.

    With `from_pool`, the query's first token is the one this sequence's last step sampled: the
    worker takes it from its device token pool, where that step left it, whether the host has read
    it back yet or not; `tokens` are the query's other tokens (committed ones, then `num_draft`
    drafts). Otherwise `tokens` is the whole query."""

    params: RequestParams
    start: int  # KV position of the first query token
    from_pool: bool
    tokens: list[int]
    num_draft: int
    samples: bool  # the query reaches the last committed token and output budget is left
    prompt_lo: int  # prompt positions [prompt_lo, prompt_hi] get their logprob entries this step
    prompt_hi: int
    slots: np.ndarray | list[int]  # int64 [num_query], KV slot of each query token
    block_table: np.ndarray  # int32 [blocks]: `BlockManager.block_table`'s view, read when the step is launched
    output_position: int  # output index of the first token this step produces
    history: list[int] | None = None  # prompt + output tokens committed before the query (penalized or grammar requests only)

    @property
    def num_query(self) -> int:
        return self.from_pool + len(self.tokens)

    @property
    def num_committed(self) -> int:
        return self.num_query - self.num_draft

    @property
    def drafts(self) -> list[int]:
        return self.tokens[len(self.tokens) - self.num_draft :]

    @property
    def rid(self) -> str:
        return self.params.rid


@dataclass(frozen=True, eq=False)  # eq=False: hashed by identity (the policy keys its bookkeeping of a launched plan by it)
class StepPlan:
    steps: list[SeqStep]
    # What every sequence of the plan shares, from the policy's running set when it made the plan
    # (counted as sequences join and leave, so the worker reads them instead of asking each
    # sequence every step); None: unknown (ask each sequence).
    output_logprob_keys: tuple[tuple[int, tuple[int, ...]] | None, ...] | None = None  # the distinct keys, one: all share it
    processes_logits: bool | None = None  # False: no sequence's logits are processed; True: some running one's are
    samples_randomly: bool | None = None  # False: every sequence's token is the argmax; True: some running one samples

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query for s in self.steps)


class SeqResult(msgspec.Struct, frozen=True):
    """What the worker returns for one sequence of the plan."""

    tokens: list[int] = []  # accepted drafts, then the next token (an empty default is copied per instance)
    output_logprobs: HostRows | None = None  # one row per entry of `tokens`
    prompt_logprobs: HostRows | None = None  # positions [prompt_lo, prompt_hi]; the null row not included
    drafts: list[int] = []  # the next block to verify
    draft_confidence: list[float] | None = None
