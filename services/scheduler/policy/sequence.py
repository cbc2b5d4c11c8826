"""A request's live state, as the policy keeps it. No torch."""

from __future__ import annotations

from dataclasses import dataclass, field

from services.scheduler.plan import RequestParams
from services.scheduler.policy.config import PolicyConfig
from services.common.logprob_rows import RequestLogprobs, RowLogprobs
from services.scheduler.request import SchedulerRequest

NOT_SAMPLED = -1  # `Sequence.sampled_position` before the sequence's first token


@dataclass(eq=False)  # identity: hashed and compared as objects (the running set), never by token lists
class Sequence:
    """`tokens` is prompt + output as the host knows them; `num_unread` more were sampled by steps
    whose results are not applied yet (launched ahead: `Policy.expect`), so the sequence is
    `num_tokens` long. The first `num_computed` tokens are in KV."""

    request: SchedulerRequest
    params: RequestParams
    arrival: int
    tokens: list[int]
    max_outputs: int  # min(max_new_tokens, max_model_len - prompt length)
    num_computed: int = 0
    num_unread: int = 0
    sampled_position: int = NOT_SAMPLED  # the position of the token its last step sampled (in the worker's token pool)
    next_prompt_logprob: int = 0  # next prompt position whose entry is not yet returned
    held_prompt: list[RowLogprobs] = field(default_factory=list)  # a flat-arrays request's prompt rows, until the prompt is in
    flat_sent: bool = False
    drafts: list[int] = field(default_factory=list)  # the proposed block the next step verifies
    draft_confidence: list[float] | None = None  # the proposer's survival estimate per draft
    speculative: bool = False  # the scheduler runs a proposer: report spec_verify_ct
    spec_verify_ct: int = 0
    forks: list[Sequence] = field(default_factory=list)  # choices waiting for this prefill, then forked
    prompt_parts: list[RequestLogprobs] = field(default_factory=list)  # prompt rows returned so far, for forks
    block_hashes: list[int] = field(default_factory=list)  # the prefix cache's chain over its full blocks of `tokens`
    hash_salt: int = 0  # the cache's salt `block_hashes` was computed with
    num_cached: int = 0  # prompt tokens it found in KV (the prefix cache, or its parent's as a fork): usage's cached_tokens
    next_commit: int = 0  # tokens in KV at which its next full block is ready for the cache
    # read several times a sequence a step: plain attributes, not properties
    rid: str = field(init=False)
    num_prompt: int = field(init=False)
    num_tokens: int = field(init=False)  # len(tokens) + num_unread, kept by `take` and `expect_token`

    def __post_init__(self) -> None:
        self.rid = self.params.rid
        self.num_prompt = len(self.params.prompt_ids)
        self.num_tokens = len(self.tokens)

    @classmethod
    def of(cls, request: SchedulerRequest, params: RequestParams, arrival: int, config: PolicyConfig) -> Sequence:
        max_outputs = min(request.sampling.max_new_tokens, config.max_model_len - len(request.prompt_ids))
        seq = cls(request, params, arrival, request.prompt_ids.tolist(), max_outputs)
        start = params.prompt_logprob_start
        seq.next_prompt_logprob = seq.num_prompt if start is None else start
        seq.speculative = config.num_draft_tokens > 0
        return seq

    @property
    def num_outputs(self) -> int:
        return self.num_tokens - self.num_prompt

    @property
    def num_pending(self) -> int:
        return self.num_tokens - self.num_computed

    def expect_token(self) -> None:
        """A launched step samples this sequence's next token; its id comes with `take`."""
        self.num_unread += 1
        self.num_tokens += 1
        self.sampled_position = self.num_tokens - 1

    def take(self, tokens: list[int], expected: bool) -> None:
        """A step's tokens, read back (one of them the token `expect_token` counted, if `expected`)."""
        self.tokens += tokens
        self.num_unread -= expected
        self.num_tokens = len(self.tokens) + self.num_unread
        self.sampled_position = len(self.tokens) - 1

    @property
    def wants_flat(self) -> bool:
        return self.params.prompt_logprob_start is not None and self.params.logprobs.flat_prompt_top_logprobs
