"""The scheduling policy as the core sees it. No torch, no device.

Requests come in (`add`, `abort`); each step, `schedule` plans who runs with which tokens (a
`StepPlan` of plain values: `plan.py`), the worker runs it, and `update(plan, results)` takes back,
per sequence, the tokens it gained (ragged: the accepted drafts and one more), their logprob rows,
and its next draft block. Plain decoding is the case of zero draft tokens.

Planning ahead (overlapped steps): where a plan's effects on its sequences are known before its
results (`can_expect`: no drafts to verify and none to await, no sampling that reads the host's
token history), `expect(plan)` counts them — each sequence's computed tokens, and one token, its id
still on the device, for each that samples — so the next `schedule(ahead=True)` plans from there
while the plan runs; `update(plan, ...)` later brings the ids. A sequence that the plan's token
finishes (a stop, EOS) is found out by that `update`, and its share of the step planned ahead is
dropped then (it is no longer running).
"""

from __future__ import annotations

import itertools
import random
from collections import deque
from dataclasses import dataclass

from contracts.detokenizer import Finish, FinishType
from services.scheduler.block_manager import BlockManager
from services.scheduler.plan import RequestParams, SeqResult, SeqStep, StepPlan
from services.scheduler.policy.admission import Admission
from services.scheduler.policy.config import PolicyConfig
from services.scheduler.policy.forks import Forks
from services.scheduler.policy.outputs import Outputs
from services.scheduler.policy.planner import Planner
from services.scheduler.policy.running import RunningSet
from services.scheduler.policy.sequence import Sequence
from services.scheduler.request import RequestOutput, SchedulerRequest


@dataclass
class _Launched:
    """A plan the worker runs: its sequences, step by step, until `update` applies its results."""

    seqs: list[Sequence]
    expected: bool = False  # `expect` counted its effects already


class _Arrivals:
    """Sequences of arriving requests, in arrival order, each with its sampling seed settled."""

    def __init__(self, config: PolicyConfig) -> None:
        self._config = config
        self._rng = random.Random(config.seed)  # sampling seeds of requests that bring none
        self._order = itertools.count()

    def sequence(self, request: SchedulerRequest) -> Sequence:
        seed = request.sampling.seed if request.sampling.seed is not None else self._rng.getrandbits(63)
        return Sequence.of(request, RequestParams.of(request, seed), next(self._order), self._config)


class Policy:
    def __init__(self, config: PolicyConfig) -> None:
        self.config = config
        self.blocks = BlockManager(config.num_blocks, config.block_size, config.prefix_caching)
        self.admission = Admission(self.blocks, config.max_model_len, config.vocab_size)
        self._waiting: deque[Sequence] = deque()
        self._running = RunningSet()
        self._outputs = Outputs()
        self._forks = Forks(self.blocks, self._waiting, self._outputs)
        self._planner = Planner(config, self.blocks, self._running, self._waiting, self._outputs, self._forks)
        self._launched: dict[StepPlan, _Launched] = {}
        self._arrivals = _Arrivals(config)
        self.num_prefix_queries = 0  # vLLM's prefix-cache queries: prompt tokens of every request admitted

    # ---- what the core asks ----

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        """Waiting sequences, forks waiting for their prompt's prefill included."""
        return len(self._waiting) + sum(len(seq.forks) for seq in (*self._running, *self._waiting))

    @property
    def num_preemptions(self) -> int:
        return self._planner.num_preemptions

    @property
    def num_prefix_hits(self) -> int:
        """Tokens whose KV a request took from another instead of computing it (the prefix cache, forked choices)."""
        return self._forks.num_prefix_hits + self._planner.num_cached_tokens

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._outputs.has_pending())

    def held(self) -> list[Sequence]:
        """Running and waiting sequences, and the forks waiting on them."""
        parents = [*self._running, *self._waiting]
        return [*parents, *(child for seq in parents for child in seq.forks)]

    def has_room(self, num_prompt_tokens: int, num_pending: int, num_choices: int = 1) -> bool:
        """Load-aware placement: one more request (added or claimed, not yet here: `num_pending`) would start soon."""
        num_held = len(self._running) + self.num_waiting + num_pending
        return self.admission.has_room(num_held, self.config.max_running_requests, num_prompt_tokens, num_choices)

    # ---- requests in and out ----

    def add(self, request: SchedulerRequest) -> None:
        seq = self._arrivals.sequence(request)
        seq.forks = [self._arrivals.sequence(request.choice(choice)) for choice in request.choices]
        error = self.admission.error(request)
        if error is not None:
            self._planner.fail(seq, error)
            return
        self.num_prefix_queries += seq.num_prompt * (1 + len(seq.forks))
        self._waiting.append(seq)

    def abort(self, rid: str, reason: str) -> None:
        seq = self._remove(rid)
        if seq is not None:
            self._outputs.finish(seq, Finish(FinishType.ABORT, message=reason))

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request held with ABORT (fatal errors, shutdown)."""
        for seq in self.held():
            self.blocks.free(seq.rid)
            self._outputs.finish(seq, Finish(FinishType.ABORT, message=message))
        self._running.clear()
        self._waiting.clear()
        self._launched.clear()
        return self.take_outputs()

    def take_outputs(self) -> list[RequestOutput]:
        """The outputs built since the last call (requests with news only)."""
        return self._outputs.take()

    def _remove(self, rid: str) -> Sequence | None:
        for seq in (*self._running, *self._waiting):
            if seq.rid == rid:
                if seq in self._running:
                    self._running.remove(seq)
                else:
                    self._waiting.remove(seq)
                self.blocks.free(rid)
                self._forks.pass_on(seq)
                return seq
            for child in seq.forks:
                if child.rid == rid:
                    seq.forks.remove(child)
                    return child
        return None

    # ---- the step ----

    def schedule(self, ahead: bool = False) -> StepPlan | None:
        """The next step's plan (it may hold no step); None only `ahead`, where it would preempt."""
        planned = self._planner.schedule(ahead)
        if planned is None:
            return None
        plan, seqs = planned
        if plan.steps:
            self._launched[plan] = _Launched(seqs)
        return plan

    def can_expect(self, plan: StepPlan) -> bool:
        """Whether `plan`'s effects are known before its results: nothing samples, or (no drafter:
        its blocks come back with the tokens) no sampling reads the token history on the host
        (penalties, logit bias, min_tokens: `logits_processing`)."""
        producers = [s for s in plan.steps if s.samples]
        if not producers:
            return True
        if self.config.num_draft_tokens > 0:
            return False
        return plan.processes_logits is False or not any(s.params.processes_logits for s in producers)

    def expect(self, plan: StepPlan) -> None:
        """Count `plan`'s effects before its results (`can_expect` holds): its sequences' computed
        tokens, and one token for each that samples, whose id `update(plan, ...)` brings."""
        launched = self._launched[plan]
        launched.expected = True
        for step, seq in zip(plan.steps, launched.seqs, strict=True):
            if seq not in self._running:
                continue  # finished or aborted since the plan was made
            seq.num_computed = step.start + step.num_query - step.num_draft
            seq.next_prompt_logprob = _next_prompt_logprob(step)
            if step.samples:
                seq.expect_token()
            if seq.num_computed >= seq.next_commit and self.blocks.cache.enabled:
                self._planner.commit(seq)  # launched: every later step reads its blocks' KV computed

    def update(self, plan: StepPlan, results: list[SeqResult]) -> list[RequestOutput]:
        """Advance every planned sequence by its result; returns the step's outputs."""
        launched = self._launched.pop(plan)
        for step, seq, result in zip(plan.steps, launched.seqs, results, strict=True):
            if seq not in self._running:
                continue  # finished or aborted since the plan was made (ahead: its token is dropped)
            if result.prompt_logprobs is not None:
                self._outputs.record_prompt(seq, step, result)
                self._planner.keep_rows(seq, step, result.prompt_logprobs)
            end = step.start + step.num_committed  # committed tokens in KV after the step
            seq.num_computed = end + max(0, len(result.tokens) - 1)
            seq.next_prompt_logprob = _next_prompt_logprob(step)
            if seq.forks or (not seq.flat_sent and seq.wants_flat and seq.num_computed >= seq.num_prompt):
                self._prompt_done(seq)
            if step.samples:
                self._append_tokens(seq, step, result, launched.expected)
            elif end == seq.num_tokens and seq.num_outputs >= seq.max_outputs:
                self._finish(seq, Finish(FinishType.LENGTH))  # nothing left to generate
            if seq.num_computed >= seq.next_commit and self.blocks.cache.enabled and seq in self._running:
                self._planner.commit(seq)
        return self.take_outputs()

    def _prompt_done(self, seq: Sequence) -> None:
        """The flat arrays once the whole prompt is in; forks once their prompt is."""
        if seq.wants_flat and not seq.flat_sent and seq.num_computed >= seq.num_prompt:
            self._outputs.attach_flat(seq)
        self._forks.advance(seq)

    def _append_tokens(self, seq: Sequence, step: SeqStep, result: SeqResult, expected: bool) -> None:
        if self.config.num_draft_tokens > 0 and step.output_position > 0:
            seq.spec_verify_ct += 1  # every forward after the first token verifies a block (maybe empty)
        num_outputs = len(seq.tokens) - seq.num_prompt  # read back so far
        kept, finish = 0, None
        for token in result.tokens:
            kept += 1
            finish = _finish_reason(seq, token, num_outputs + kept, self.config.eos_ids)
            if finish is not None:
                break
        tokens = result.tokens if kept == len(result.tokens) else result.tokens[:kept]
        seq.take(tokens, expected)
        # a row per verified position (the worker's output queries), cut to the tokens kept
        self._outputs.add_tokens(seq, tokens, result.output_logprobs)
        seq.drafts = result.drafts if finish is None else []
        seq.draft_confidence = result.draft_confidence
        if finish is not None:
            self._finish(seq, finish)

    def _finish(self, seq: Sequence, finish: Finish) -> None:
        self._running.remove(seq)
        if self.blocks.cache.enabled:
            self._planner.commit(seq)  # its last full blocks, with the tokens of this step
        self.blocks.free(seq.rid)
        self._outputs.finish(seq, finish)


def _finish_reason(seq: Sequence, token_id: int, num_outputs: int, eos_ids: frozenset[int]) -> Finish | None:
    sampling = seq.params.sampling
    if token_id in sampling.stop_token_ids:
        return Finish(FinishType.STOP, matched=token_id)
    if token_id in eos_ids and not sampling.ignore_eos:
        return Finish(FinishType.STOP, matched=token_id)
    if num_outputs >= seq.max_outputs:
        return Finish(FinishType.LENGTH)
    return None


def _next_prompt_logprob(step: SeqStep) -> int:
    """The first prompt position whose logprob entry is still to come once `step` is applied: past its
    rows where it computed any (the worker asks for rows [prompt_lo, prompt_hi] when not empty)."""
    return step.prompt_hi + 1 if step.prompt_lo <= step.prompt_hi else step.prompt_lo
