"""The scheduling policy: who runs this step, with which tokens. No torch, no device.

`schedule()` returns a `StepPlan`: per sequence, the query tokens to compute this step (committed
tokens not yet in KV, then draft tokens to verify) and whether it produces tokens. The worker runs
the plan and `update(plan, results)` takes back, per sequence, the tokens it gained (ragged: the
accepted drafts and one more), their logprob rows, and its next draft block. Plain decoding is the
case of zero draft tokens.

Scheduling: running requests first, oldest first (a decode is its last token plus its drafts; a
prefill chunk takes what is left of `chunk_budget`), then waiting requests while the token budget,
the running limit and free KV blocks allow. A step in which no sequence decodes has nothing to
stall, so its budget is `prefill_budget` (>= `chunk_budget`): a long prompt that arrives alone
prefills in a few large steps instead of many small ones. When a running request needs a block and none is free,
the newest running request is preempted: its blocks are freed and it goes back to the front of
the queue; on resume it re-prefills prompt + generated tokens (its pending drafts ride on the last
chunk), and since sampling depends only on (seed, output position) and logprobs already returned
are not returned again, its results are those it would have had alone.

Forks (`n` > 1): a request's other choices wait on it (`Sequence.forks`) until its prefill is
done, then each starts with the prompt's full blocks shared (`BlockManager.fork`) and the
prompt's logprob entries copied; it computes only the prompt's tail itself (see `_fork`). From
then on a forked choice is a sequence like any other: aborting it frees its own holds, a
preempted one re-prefills its whole prompt + output alone.
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass
from typing import NoReturn

import msgspec
import numpy as np
import structlog

from contracts.detokenizer import Finish, FinishType
from services.common.flat_logprobs import FlatLogprobsError, build_flat_top_logprobs
from services.scheduler.block_manager import BlockManager
from services.scheduler.request import HostRows, LogprobEntries, RequestOutput, SchedulerRequest, Sequence

log = structlog.get_logger(__name__)


FOLLOWED_TOKEN = -1  # the query of a followed decode (`Policy.follow_decodes`): the device has its token


class SeqStep(msgspec.Struct, frozen=True):
    """One sequence's share of a step. (Per-sequence-per-step objects are frozen `msgspec.Struct`s, not
    frozen dataclasses: ~0.06 against ~1.2 us to build one of ten fields, a cost paid 64 times a step
    at batch 64.)"""

    seq: Sequence
    start: int  # KV position of the first query token
    query: list[int]  # committed tokens not yet in KV, then `num_draft` draft tokens
    num_draft: int
    samples: bool  # the query reaches the last committed token and output budget is left
    prompt_lo: int  # prompt positions [prompt_lo, prompt_hi] get their logprob entries this step
    prompt_hi: int
    slots: np.ndarray | list[int]  # int64 [len(query)], KV slot of each query token
    block_table: np.ndarray  # int32 [blocks]: `BlockManager.block_table`'s view, read when the step is launched
    output_position: int  # output index of the first token this step produces

    @property
    def num_committed(self) -> int:
        return len(self.query) - self.num_draft

    @property
    def drafts(self) -> list[int]:
        return self.query[self.num_committed :]


@dataclass(frozen=True)
class StepPlan:
    steps: list[SeqStep]
    # What every sequence of the plan shares, from the policy's running set when it made the plan
    # (`RunningSet`: counted as sequences join and leave, so the worker reads them instead of
    # asking each sequence every step); None: unknown (ask each sequence).
    output_logprob_keys: tuple[tuple[int, tuple[int, ...]] | None, ...] | None = None  # the distinct keys, one: all share it
    processes_logits: bool | None = None  # False: no sequence's logits are processed; True: some running one's are
    samples_randomly: bool | None = None  # False: every sequence's token is the argmax; True: some running one samples

    @property
    def num_tokens(self) -> int:
        return sum(len(s.query) for s in self.steps)


class SeqResult(msgspec.Struct, frozen=True):
    """What the worker returns for one sequence of the plan."""

    tokens: list[int] = []  # accepted drafts, then the next token (an empty default is copied per instance)
    output_logprobs: HostRows | None = None  # one row per entry of `tokens`
    prompt_logprobs: HostRows | None = None  # positions [prompt_lo, prompt_hi]; the null row not included
    drafts: list[int] = []  # the next block to verify
    draft_confidence: list[float] | None = None


class _Pending(msgspec.Struct):
    """One request's output under construction during a step."""

    seq: Sequence
    new_token_ids: list[int] = []  # an empty default is copied per instance
    logprobs: LogprobEntries = msgspec.field(default_factory=LogprobEntries)
    finish: Finish | None = None


class RunningSet(dict):
    """The running sequences, oldest first: a dict (seq -> None) as an ordered set, by identity
    (`Sequence` has eq=False), so membership and removal are O(1) where a list made each step's
    membership tests O(B^2); a dict subclass, so `in`, iteration and `len` stay the dict's own
    (asked per sequence per step). Sequences join and leave through `add` and `remove` (never
    `running[seq] = ...` or `del`), which count what the worker would otherwise ask of every sequence
    of every step: `plan` hands those counts on (`StepPlan.output_logprob_keys`, `processes_logits`,
    `samples_randomly`); the dict's other ways in and out raise, so no change can skip the counts."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[tuple[int, tuple[int, ...]] | None, int] = {}  # output_logprob_key -> running sequences
        self._num_processing = 0  # running sequences whose logits a processor changes
        self._num_random = 0  # running sequences that sample (temperature > 0)

    def add(self, seq: Sequence) -> None:
        dict.__setitem__(self, seq, None)
        key = seq.output_logprob_key
        self._keys[key] = self._keys.get(key, 0) + 1
        self._num_processing += seq.processes_logits
        self._num_random += seq.samples_randomly

    def remove(self, seq: Sequence) -> None:
        dict.__delitem__(self, seq)
        key = seq.output_logprob_key
        if self._keys[key] == 1:
            del self._keys[key]
        else:
            self._keys[key] -= 1
        self._num_processing -= seq.processes_logits
        self._num_random -= seq.samples_randomly

    def clear(self) -> None:
        super().clear()
        self._keys.clear()
        self._num_processing = 0
        self._num_random = 0

    def _uncounted(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("RunningSet: sequences join and leave through add() and remove(), which keep its counts")

    __setitem__ = __delitem__ = __ior__ = pop = popitem = setdefault = update = _uncounted

    def plan(self, steps: list[SeqStep]) -> StepPlan:
        """A plan of running sequences only, with what they share (counted now)."""
        return StepPlan(steps, tuple(self._keys), self._num_processing > 0, self._num_random > 0)


@dataclass(frozen=True)
class PolicyConfig:
    """The policy's limits and the model facts it schedules by."""

    num_blocks: int
    block_size: int
    max_running_requests: int
    chunk_budget: int  # tokens per step
    max_model_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    prefill_budget: int | None = None  # tokens per step while nothing decodes; None: chunk_budget
    num_draft_tokens: int = 0
    verify_mode: str = "static"
    confidence_threshold: float = 0.3
    seed: int = 0  # seeds the sampling seeds of requests that bring none


class Policy:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size)
        self.max_model_len = config.max_model_len
        self.vocab_size = config.vocab_size
        self.num_draft_tokens = config.num_draft_tokens
        self.verify_mode = config.verify_mode
        self.confidence_threshold = config.confidence_threshold
        self._eos_ids = config.eos_ids
        self._max_running = config.max_running_requests
        self._chunk_budget = config.chunk_budget
        self._prefill_budget = max(config.chunk_budget, config.prefill_budget or config.chunk_budget)
        self._rng = random.Random(config.seed)  # sampling seeds of requests that bring none
        self._waiting: deque[Sequence] = deque()
        self._running = RunningSet()
        self._arrivals = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self.num_preemptions = 0
        # vLLM's prefix-cache counts: prompt tokens of every request admitted (queries) and those
        # whose KV a request took from another instead of computing it (hits: forked choices)
        self.num_prefix_queries = 0
        self.num_prefix_hits = 0

    # ---- what the core asks ----

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Waiting sequences, forks waiting for their prompt's prefill included."""
        return len(self._waiting) + sum(len(seq.forks) for seq in (*self._running, *self._waiting))

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._pending)

    def held(self) -> list[Sequence]:
        """Running and waiting sequences, and the forks waiting on them."""
        parents = [*self._running, *self._waiting]
        return [*parents, *(child for seq in parents for child in seq.forks)]

    def claim_error(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run here; None when it can."""
        if num_prompt_tokens >= self.max_model_len:  # as the tokenizer: room for one new token at least
            return f"the prompt has {num_prompt_tokens} tokens; max_model_len is {self.max_model_len}"
        if self.blocks.num_blocks_for(num_prompt_tokens + 1) > self.blocks.num_blocks:
            return f"the prompt has {num_prompt_tokens} tokens, more than the KV cache holds"
        return None

    def has_room(self, num_prompt_tokens: int, num_pending: int, num_choices: int = 1) -> bool:
        """A new request would start soon: running + waiting + `num_pending` (added or claimed,
        not yet here) stay under the running limit, and the KV blocks of the prompt and of its
        choices' own tails (the prompt's full blocks counted once) are free now."""
        num_held = len(self._running) + self.num_waiting + num_pending
        blocks = self.blocks.num_blocks_for(num_prompt_tokens + 1)
        tail_blocks = blocks - self._num_shared_tokens(num_prompt_tokens) // self.blocks.block_size
        return num_held < self._max_running and self.blocks.num_free_blocks >= blocks + (num_choices - 1) * tail_blocks

    def _num_shared_tokens(self, num_prompt: int) -> int:
        """Prompt tokens forks share: the full blocks before the last prompt token (see `_fork`)."""
        return (num_prompt - 1) // self.blocks.block_size * self.blocks.block_size

    # ---- requests in and out ----

    def add(self, request: SchedulerRequest) -> None:
        seq = self._sequence(request)
        seq.forks = [self._sequence(request.choice(choice)) for choice in request.choices]
        error = self.validate(request)
        if error is not None:
            self._fail(seq, Finish(FinishType.ABORT, message=error))
            return
        self.num_prefix_queries += seq.num_prompt * (1 + len(seq.forks))
        self._waiting.append(seq)

    def _sequence(self, request: SchedulerRequest) -> Sequence:
        seq = Sequence(request, next(self._arrivals), request.prompt_ids.tolist(), max_outputs=0)
        seq.max_outputs = min(request.sampling.max_new_tokens, self.max_model_len - seq.num_prompt)
        start = seq.prompt_logprob_start
        seq.next_prompt_logprob = seq.num_prompt if start is None else start
        seed = request.sampling.seed
        seq.sampling_seed = seed if seed is not None else self._rng.getrandbits(63)
        seq.speculative = self.num_draft_tokens > 0
        return seq

    def validate(self, request: SchedulerRequest) -> str | None:
        """Why the core cannot run `request`, in words for the user; None when it can."""
        num_prompt = len(request.prompt_ids)
        if num_prompt == 0:
            return "the prompt is empty"
        too_long = self.claim_error(num_prompt)
        if too_long is not None:
            return too_long
        if request.prompt_ids.min() < 0 or request.prompt_ids.max() >= self.vocab_size:
            return f"prompt token ids must be in [0, {self.vocab_size})"
        ids = request.logprobs.token_ids_logprob
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            return f"token_ids_logprob must be in [0, {self.vocab_size})"
        if not 0 <= request.logprobs.top_logprobs_num <= self.vocab_size:
            return f"top_logprobs_num must be in [0, {self.vocab_size}]"
        if request.sampling.max_new_tokens < 0:
            return "max_new_tokens must be >= 0"
        return None

    def abort(self, rid: str, reason: str) -> None:
        seq = self._remove(rid)
        if seq is not None:
            self._entry(seq).finish = Finish(FinishType.ABORT, message=reason)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request held with ABORT (fatal errors, shutdown)."""
        for seq in self.held():
            self.blocks.free(seq.rid)
            self._entry(seq).finish = Finish(FinishType.ABORT, message=message)
        self._running.clear()
        self._waiting.clear()
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs built since the last call (requests with news only)."""
        pending, self._pending = self._pending, {}
        return [_to_output(p) for p in pending.values() if _has_news(p)]

    def _remove(self, rid: str) -> Sequence | None:
        for seq in (*self._running, *self._waiting):
            if seq.rid == rid:
                if seq in self._running:
                    self._running.remove(seq)
                else:
                    self._waiting.remove(seq)
                self.blocks.free(rid)
                self._pass_forks_on(seq)
                return seq
            for child in seq.forks:
                if child.rid == rid:
                    seq.forks.remove(child)
                    return child
        return None

    def _pass_forks_on(self, seq: Sequence) -> None:
        """`seq` leaves before its prefill was done: its first fork takes the others and prefills alone."""
        if seq.forks:
            heir, *others = seq.forks
            heir.forks, seq.forks = others, []
            self._waiting.appendleft(heir)

    def _fail(self, seq: Sequence, finish: Finish) -> None:
        """Finish `seq` (holding no blocks) and the forks waiting on it: they share its prompt."""
        for each in (seq, *seq.forks):
            self._entry(each).finish = finish
        seq.forks = []

    # ---- schedule ----

    def schedule(self) -> StepPlan:
        decoding = any(seq.num_pending == 1 for seq in self._running)  # a decode (or verify) this step
        budget = self._chunk_budget if decoding else self._prefill_budget
        chosen: list[tuple[Sequence, int, int]] = []  # (seq, committed tokens, drafts)
        for seq in list(self._running):
            if seq not in self._running:
                continue  # preempted for an older request this step
            num_tokens, num_draft = self._query_size(seq, budget)
            if num_tokens <= 0:
                continue
            if not self._reserve(seq, seq.num_computed + num_tokens + num_draft):
                break  # seq itself was the newest: preempted (or failed)
            chosen.append((seq, num_tokens, num_draft))
            budget -= num_tokens + num_draft
        chosen.extend(self._admit(budget))
        return self._running.plan([self._seq_step(seq, n, k) for seq, n, k in chosen])

    def follow_decodes(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan`, planned before `plan`'s results are known (overlapped decoding: the
        worker launches it while `plan` runs, and `update(plan, ...)` comes after): each sequence of
        `plan` decodes once more, its query the token `plan` samples for it, which only the device
        has yet (`FOLLOWED_TOKEN` stands in for it here). A sequence that `plan`'s token finishes
        (a stop, EOS) is found out by `update(plan, ...)`, and its share of this step is dropped by
        `update` then (it is no longer running); its KV slot was freed with it, and nothing reads it.

        Waiting requests that can be admitted now join it as `schedule` would admit them beside
        decodes (their first chunks within the chunk budget, never by preempting): their tokens are
        the prompt's, known here, so arrivals do not stop the overlap (a mixed step that waited for
        the last step's readback cost the 0.6B 5.6 ms against 2.9 followed, at concurrency 64 on an
        H100: ops/bench/results/gpu_serve.md, 0.6B run 30).

        A sequence whose output budget `plan`'s token spends is left out. None when the next step
        needs `schedule` instead: drafts, a step of `plan` that samples nothing (a prefill chunk
        before the prompt's end), nothing left to decode, or not enough free KV blocks without
        preempting.

        Safe with the KV blocks it frees early because the device runs every step on one stream: a
        block freed by a finish or an abort while the followed step still writes into it is next
        written or read only by steps queued after that one (a side stream touching the KV cache
        would break this)."""
        if self.num_draft_tokens > 0 or any(not s.samples or s.num_draft > 0 for s in plan.steps):
            return None
        # a sequence whose budget `plan`'s token spends has nothing more to decode (its finish comes with update)
        steps = [s for s in plan.steps if s.seq in self._running and s.output_position + 1 < s.seq.max_outputs]
        if not steps:
            return None
        ends = [s.start + s.num_committed + 1 for s in steps]  # KV length after the next step
        grown = self.blocks.grow_by_one([s.seq.rid for s in steps], ends)
        if grown is None:
            return None
        # a decode returns no prompt logprobs: prompt rows [num_prompt, num_prompt - 1]
        followed = [SeqStep(step.seq, end - 1, [FOLLOWED_TOKEN], 0, True, step.seq.num_prompt, step.seq.num_prompt - 1, [slot],
                            table, step.output_position + 1) for step, end, slot, table in zip(steps, ends, *grown, strict=True)]  # fmt: skip
        admitted = self._admit(self._chunk_budget - len(followed)) if self._can_admit_next() else []
        return self._running.plan(followed + [self._seq_step(seq, n, k) for seq, n, k in admitted])

    def follow_prefill(self, plan: StepPlan) -> StepPlan | None:
        """The step after `plan`, planned before `plan`'s results are known, when `plan` is prompt
        chunks only and none of them samples (a long prompt, or several, while nothing decodes): each
        continues with its next chunk, as `schedule` would plan it once `update(plan, ...)` has
        advanced them. Nothing of a chunk's result decides the next one (its tokens are the prompt's;
        its prompt-logprob rows are only passed on), so the device goes from one chunk to the next
        without waiting for the host to read back the first (a 16k-token step's logprob rows, then
        the next step's batch: ops/bench/results/gpu_prefill_profile.md, run 8).

        None when `schedule` must plan the next step instead: a step of `plan` that samples or that
        ends its sequence's pending tokens, a running sequence not in `plan` (it would decode), a
        waiting request it could admit now, or KV blocks that only preemption would free."""
        seqs = {id(s.seq) for s in plan.steps}
        if (self._can_admit_next() or len(seqs) != len(plan.steps) or len(self._running) != len(plan.steps)
                or any(s.samples or s.seq not in self._running or s.start + s.num_committed >= len(s.seq.tokens)
                       for s in plan.steps)):  # fmt: skip
            return None
        budget, chosen = self._prefill_budget, []  # nothing decodes: `schedule`'s budget
        for step in plan.steps:
            start = step.start + step.num_committed
            num_tokens = min(len(step.seq.tokens) - start, budget)
            if num_tokens <= 0:
                break
            chosen.append((step, start, num_tokens))
            budget -= num_tokens
        ends = [(step.seq.rid, start + n) for step, start, n in chosen]
        if sum(self.blocks.num_new_blocks(rid, end) for rid, end in ends) > self.blocks.num_free_blocks:
            return None
        for rid, end in ends:
            self.blocks.allocate(rid, end)
        return self._running.plan([self._seq_step(step.seq, n, 0, start, _next_prompt_logprob(step)) for step, start, n in chosen])

    def _query_size(self, seq: Sequence, budget: int) -> tuple[int, int]:
        """(committed tokens, drafts) to compute: a decode always runs; a prefill chunk fits the budget;
        drafts ride along only once every committed token is in the query."""
        pending = seq.num_pending
        num_tokens = pending if pending == 1 else min(pending, budget)
        if num_tokens < pending:
            return num_tokens, 0
        # Drafts past max_new_tokens are verified anyway (the finish drops what follows it): a full block
        # for every decoding sequence keeps the step's queries uniform, so it replays a CUDA graph.
        room = self.max_model_len - len(seq.tokens)  # KV positions left after the anchor
        left = budget - num_tokens if pending > 1 else len(seq.drafts)
        return num_tokens, max(0, min(self._num_to_verify(seq), room, left))

    def _num_to_verify(self, seq: Sequence) -> int:
        """`static`: the whole block. `compact`: the longest prefix whose survival, the product of the
        drafter's confidences, stays >= `confidence_threshold` (at least one draft). Choosing fewer
        drafts from the drafter's own outputs keeps verification lossless."""
        if self.verify_mode == "static" or seq.draft_confidence is None:
            return len(seq.drafts)
        survival, count = 1.0, 0
        for confidence in seq.draft_confidence[: len(seq.drafts)]:
            survival *= confidence
            if survival < self.confidence_threshold and count > 0:
                break
            count += 1
        return count

    def _reserve(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for `num_tokens` of `seq` in KV, preempting the newest running requests."""
        while not self.blocks.can_allocate(seq.rid, num_tokens):
            victim = next(reversed(self._running))
            if victim is seq and len(self._running) == 1:
                if self._drop_waiting_holds():
                    continue
                self._running.remove(seq)
                self.blocks.free(seq.rid)
                message = f"the KV cache cannot hold {num_tokens} tokens of this request"
                self._fail(seq, Finish(FinishType.ABORT, message=message))
                return False
            self._preempt(victim)
            if victim is seq:
                return False
        self.blocks.allocate(seq.rid, num_tokens)
        return True

    def _preempt(self, seq: Sequence) -> None:
        self._running.remove(seq)
        self.blocks.free(seq.rid)
        seq.num_computed = 0
        self._waiting.appendleft(seq)
        self.num_preemptions += 1
        log.debug("scheduler.preempt", rid=seq.rid, tokens=len(seq.tokens))

    def _can_admit_next(self) -> bool:
        """Whether `_admit` could take the head of the queue now: a running slot free and its first
        token's KV blocks (plus the per-running-request reserve) free. A guess on the generous side
        (one token, not its whole first chunk): a wrong True only costs one step its overlap."""
        if not self._waiting or len(self._running) >= self._max_running:
            return False
        seq = self._waiting[0]
        needed = self.blocks.num_new_blocks(seq.rid, seq.num_computed + 1) + len(self._running)
        return needed <= self.blocks.num_free_blocks or not self._running

    def _admit(self, budget: int) -> list[tuple[Sequence, int, int]]:
        admitted = []
        while self._waiting and budget > 0 and len(self._running) < self._max_running:
            seq = self._waiting[0]
            num_tokens, num_draft = self._query_size(seq, budget)
            total = seq.num_computed + num_tokens + num_draft  # a fork starts with its prompt's shared blocks
            # keep one block per running request free so admissions rarely force a preemption
            reserve = len(self._running)
            needed = self.blocks.num_new_blocks(seq.rid, total) + reserve
            if needed > self.blocks.num_free_blocks and self._running:
                break
            if not self.blocks.can_allocate(seq.rid, total):
                if not self._running:  # alone and still too big: it can never run
                    if self._drop_waiting_holds():
                        continue
                    self._waiting.popleft()
                    self.blocks.free(seq.rid)
                    message = f"the KV cache cannot hold {num_tokens} tokens of this request"
                    self._fail(seq, Finish(FinishType.ABORT, message=message))
                    continue
                break
            self._waiting.popleft()
            self.blocks.allocate(seq.rid, total)
            self._running.add(seq)
            admitted.append((seq, num_tokens, num_draft))
            budget -= num_tokens + num_draft
        return admitted

    def _seq_step(
        self, seq: Sequence, num_tokens: int, num_draft: int, start: int | None = None, prompt_lo: int | None = None
    ) -> SeqStep:
        """start, prompt_lo: where the sequence stands (None: as its last update left it; a followed
        chunk gives where the chunk before it ends)."""
        start = seq.num_computed if start is None else start
        end = start + num_tokens  # committed tokens computed through this step
        query = seq.tokens[start:end] + seq.drafts[:num_draft]
        samples = end == len(seq.tokens) and seq.num_outputs < seq.max_outputs
        lo = seq.next_prompt_logprob if prompt_lo is None else prompt_lo
        hi = min(end, seq.num_prompt - 1)  # position p comes from row p - 1
        slots = self.blocks.slots(seq.rid, start, start + len(query))
        table = self.blocks.block_table(seq.rid)
        return SeqStep(seq, start, query, num_draft, samples, lo, hi, slots, table, seq.num_outputs)

    # ---- update ----

    def update(self, plan: StepPlan, results: list[SeqResult]) -> list[RequestOutput]:
        """Advance every planned sequence by its result; returns the step's outputs."""
        for step, result in zip(plan.steps, results, strict=True):
            seq = step.seq
            if seq not in self._running:
                continue  # finished or aborted since `plan` was launched (overlapped decoding: its token is dropped)
            self._record_prompt(step, result)
            num_accepted = max(0, len(result.tokens) - 1)
            seq.num_computed = step.start + step.num_committed + num_accepted
            if seq.wants_flat and not seq.flat_sent and seq.num_computed >= seq.num_prompt:
                self._attach_flat(seq)
            if seq.forks:
                self._keep_prompt_part(seq)
                if seq.num_computed >= seq.num_prompt:
                    self._fork(seq)
            if step.samples:
                self._append_tokens(step, result)
            elif step.start + step.num_committed == len(seq.tokens) and seq.num_outputs >= seq.max_outputs:
                self._finish(seq, Finish(FinishType.LENGTH))  # nothing left to generate
        return self.take_outputs()

    def _append_tokens(self, step: SeqStep, result: SeqResult) -> None:
        seq = step.seq
        if self.num_draft_tokens > 0 and step.output_position > 0:
            seq.spec_verify_ct += 1  # every forward after the first token verifies a block (maybe empty)
        kept = 0
        finish = None
        for token in result.tokens:
            seq.tokens.append(token)
            kept += 1
            finish = self._finish_reason(seq, token)
            if finish is not None:
                break
        entry = self._entry(seq)
        entry.new_token_ids.extend(result.tokens[:kept])
        if result.output_logprobs is not None:
            # A row per verified position (num_draft + 1: the worker's output queries), cut to the
            # tokens kept; a step without drafts has one row and keeps its one token, so the cut (a
            # call per request a step, 2% of the serving scheduler's GIL: gpu_serve.md, 0.6B run 37) is skipped.
            rows = result.output_logprobs
            entry.logprobs.output = rows if step.num_draft == 0 else rows.head(kept)
        seq.drafts = result.drafts if finish is None else []
        seq.draft_confidence = result.draft_confidence
        if finish is not None:
            self._finish(seq, finish)

    def _finish_reason(self, seq: Sequence, token_id: int) -> Finish | None:
        sampling = seq.request.sampling
        if token_id in sampling.stop_token_ids:
            return Finish(FinishType.STOP, matched=token_id)
        if token_id in self._eos_ids and not sampling.ignore_eos:
            return Finish(FinishType.STOP, matched=token_id)
        if seq.num_outputs >= seq.max_outputs:
            return Finish(FinishType.LENGTH)
        return None

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        self._running.remove(seq)
        self.blocks.free(seq.rid)
        self._entry(seq).finish = finish

    # ---- forks ----

    def _keep_prompt_part(self, seq: Sequence) -> None:
        entry = self._pending.get(seq.rid)
        if entry is not None and entry.seq is seq and not entry.logprobs.is_empty():
            seq.prompt_parts.append(entry.logprobs.prompt_part())

    def _drop_waiting_holds(self) -> bool:
        """Waiting forks hold their prompt's shared blocks, the last holders once choice 0 was
        preempted or finished: before anything is aborted for want of KV, they let go of them and
        will re-prefill alone (as preempted). Whether any did."""
        holders = [seq for seq in self._waiting if self.blocks.holds(seq.rid)]
        for seq in holders:
            self.blocks.free(seq.rid)
            seq.num_computed = 0
        return bool(holders)

    def _fork(self, parent: Sequence) -> None:
        """The prompt is in KV: each waiting choice starts from it, first in the queue.

        A fork shares the prompt's full blocks before the last prompt token and recomputes the
        rest itself (1 to block_size tokens) instead of copying the partial last block on the
        device: the partial block is the fork's own to write into from its first output on, the
        recompute needs no worker change, it writes the drafter's context rows (same slots) too,
        and it samples the fork's first token from its own row with its own seed, as if alone.
        """
        shared = self._num_shared_tokens(parent.num_prompt)
        prompt = LogprobEntries.joined_prompt(parent.prompt_parts)
        for child in parent.forks:
            self.blocks.fork(parent.rid, child.rid, shared)
            child.num_computed = shared
            self.num_prefix_hits += shared
            child.next_prompt_logprob, child.flat_sent = child.num_prompt, True  # returned here, once
            if child.wants_logprobs and not prompt.is_empty():
                self._entry(child).logprobs = msgspec.structs.replace(prompt)  # a copy
        self._waiting.extendleft(reversed(parent.forks))
        parent.forks, parent.prompt_parts = [], []

    # ---- prompt logprobs ----

    def _record_prompt(self, step: SeqStep, result: SeqResult) -> None:
        if result.prompt_logprobs is None:
            return
        seq, lo = step.seq, step.prompt_lo
        rows = result.prompt_logprobs
        if lo == seq.prompt_logprob_start:
            rows = rows.with_null_row()
        entries = self._entry(seq).logprobs
        entries.input_start = lo
        entries.input_token_logprobs = rows.token
        entries.input_ids_logprobs = rows.ids if seq.request.logprobs.token_ids_logprob else None
        if seq.wants_flat:
            seq.flat_values.append(rows.top_values)
            seq.flat_ids.append(rows.top_ids)
        elif seq.request.logprobs.top_logprobs_num > 0:
            entries.input_top_logprobs = rows.top_values
            entries.input_top_ids = rows.top_ids
        seq.next_prompt_logprob = _next_prompt_logprob(step)

    def _attach_flat(self, seq: Sequence) -> None:
        """PRODUCT §5: build the flat prompt top arrays once, when the whole prompt is in. Rows that
        cannot be represented fall back to nested rows (with a warning) for this request only."""
        k = seq.request.logprobs.top_logprobs_num
        values = np.concatenate(seq.flat_values) if seq.flat_values else np.zeros((0, k), np.float32)
        ids = np.concatenate(seq.flat_ids) if seq.flat_ids else np.zeros((0, k), np.int32)
        seq.flat_values, seq.flat_ids, seq.flat_sent = [], [], True
        entries = self._entry(seq).logprobs
        try:
            flat = build_flat_top_logprobs(values, ids, k)
        except FlatLogprobsError as exc:
            log.warning("scheduler.flat_logprobs_fallback", rid=seq.rid, error=str(exc))
            entries.input_top_logprobs, entries.input_top_ids = values, ids  # every prompt row, in order
            return
        entries.input_top_logprobs_flat = flat.values
        entries.input_top_ids_flat = flat.ids
        entries.input_top_null_prefix = flat.null_prefix

    # ---- outputs ----

    def _entry(self, seq: Sequence) -> _Pending:
        entry = self._pending.get(seq.rid)
        if entry is None or entry.seq is not seq:
            entry = self._pending[seq.rid] = _Pending(seq)
        return entry


def _to_output(entry: _Pending) -> RequestOutput:
    seq = entry.seq
    request = seq.request
    return RequestOutput(
        rid=request.rid,
        detokenizer_id=request.detokenizer_id,
        new_token_ids=entry.new_token_ids,
        prompt_tokens=len(request.prompt_ids),
        finish=entry.finish,
        logprobs=entry.logprobs if seq.wants_logprobs else None,
        spec_verify_ct=seq.spec_verify_ct if seq.speculative else None,
    )


def _next_prompt_logprob(step: SeqStep) -> int:
    """The first prompt position whose logprob entry is still to come once `step` is applied: past its
    rows where it computed any (the worker asks for rows [prompt_lo, prompt_hi] when not empty)."""
    return step.prompt_hi + 1 if step.prompt_lo <= step.prompt_hi else step.prompt_lo


def _has_news(entry: _Pending) -> bool:
    return bool(entry.new_token_ids) or entry.finish is not None or not entry.logprobs.is_empty()
