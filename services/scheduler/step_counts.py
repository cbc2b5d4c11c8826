"""What the core counts as it steps: totals for metrics and heartbeats (`StepCounts`), each
request's queue time (`QueueTimes`), and the shape of one step for the step trace (`StepRecord`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.plan import SeqResult, SeqStep, StepPlan
from services.scheduler.request import RequestOutput


@dataclass(frozen=True)
class SchedulerStats:
    """A snapshot for metrics and heartbeats."""

    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int  # computed prompt (prefill) tokens, re-prefills included
    num_generated_tokens: int
    num_drafted_tokens: int  # draft tokens sent to verification
    num_accepted_tokens: int  # of those, accepted
    accept_lengths: tuple[int, ...] = ()  # [gamma + 2]: verify passes that yielded n tokens (bonus included)
    forward_s: float = 0.0  # target forward + verify + logprobs, summed over steps
    draft_s: float = 0.0  # drafter inject + propose, summed over steps
    num_prefix_queries: int = 0  # prompt tokens of the requests added (vLLM's prefix-cache queries)
    num_prefix_hits: int = 0  # of those, tokens whose KV was found computed (the prefix cache, forked choices)

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks


class StepCounts:
    """Running totals over the steps collected."""

    def __init__(self, num_draft_tokens: int) -> None:
        self.prompt = self.generated = self.drafted = self.accepted = 0
        self.forward_s = self.draft_s = 0.0
        self.accept_lengths = [0] * (num_draft_tokens + 2) if num_draft_tokens > 0 else []

    def count(self, plan: StepPlan, results: list[SeqResult], outputs: list[RequestOutput], worker) -> None:
        self.generated += sum(len(o.new_token_ids) for o in outputs)
        for step, result in zip(plan.steps, results, strict=True):
            if step.start < step.params.num_prompt:  # else a decode: no prompt tokens
                self.prompt += num_prefill_tokens(step)
            if step.samples:
                self.drafted += step.num_draft
                self.accepted += max(0, len(result.tokens) - 1)
                if self.accept_lengths and step.output_position > 0:  # a verify pass (see spec_verify_ct)
                    self.accept_lengths[min(len(result.tokens), len(self.accept_lengths) - 1)] += 1
        self.forward_s += worker.last_forward_s
        self.draft_s += worker.last_draft_s

    def stats(self, policy, num_steps: int) -> SchedulerStats:
        blocks = policy.blocks
        return SchedulerStats(
            policy.num_running, policy.num_waiting, blocks.num_free_blocks, blocks.num_blocks, policy.num_preemptions,
            num_steps, self.prompt, self.generated, self.drafted, self.accepted, tuple(self.accept_lengths),
            self.forward_s, self.draft_s, policy.num_prefix_queries, policy.num_prefix_hits,
        )  # fmt: skip


class QueueTimes:
    """vLLM's `request_queue_time_seconds`: from a request's arrival (`add`) until the first plan
    that includes it (its first prefill chunk)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._unscheduled: dict[str, float] = {}  # rid -> arrival, until a plan first includes it
        self._taken: dict[str, float] = {}  # rid -> seconds from arrival to first scheduled, until taken

    def arrived(self, arrivals: dict[str, float]) -> None:
        self._unscheduled.update(arrivals)

    def scheduled(self, plan: StepPlan) -> None:
        if not self._unscheduled:
            return  # steady decoding: nothing waits for its first step
        now = self._clock()
        for step in plan.steps:
            arrived = self._unscheduled.pop(step.rid, None)
            if arrived is not None:
                self._taken[step.rid] = now - arrived

    def forget(self, rids: list[str]) -> None:
        """Requests finished before any plan included them (refused, aborted): no queue time."""
        for rid in rids:
            self._unscheduled.pop(rid, None)

    def clear(self) -> None:
        self._unscheduled.clear()

    def take(self) -> dict[str, float]:
        taken, self._taken = self._taken, {}
        return taken


@dataclass(frozen=True)
class StepRecord:
    """What one `step` ran, for the step trace (`step_trace.py`): its plan's shape, whether it was
    launched before the step ahead of it was read back (`followed`), whether it launched the next
    one that way (`follows`), how long the host waited for its readback (`wait_s`: the device's
    share of the step, when the host is ahead; 0 where the device had finished first and idled for
    the host), and how long collecting took (`collect_s`: the wait, then the readback's split into
    per-sequence results)."""

    num_seqs: int
    num_tokens: int
    num_prefill_tokens: int  # prompt tokens computed (chunks and re-prefills)
    num_sampling: int  # sequences that sampled (a decode, a verify or a prompt's last chunk)
    followed: bool
    follows: bool
    collect_s: float
    wait_s: float


def step_record(plan: StepPlan, followed: bool, follows: bool, collect_s: float, wait_s: float) -> StepRecord:
    steps = plan.steps
    return StepRecord(len(steps), plan.num_tokens, sum(num_prefill_tokens(s) for s in steps),
                      sum(s.samples for s in steps), followed, follows, collect_s, wait_s)  # fmt: skip


def num_prefill_tokens(step: SeqStep) -> int:
    return max(0, min(step.start + step.num_committed, step.params.num_prompt) - step.start)
