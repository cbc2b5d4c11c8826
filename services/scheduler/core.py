"""The scheduler core: a policy that plans, a worker that runs, one step at a time.

A plain object (no NATS, no asyncio). `add` and `abort` may be called from any thread: they only
append to a lock-protected inbox that `step` drains first. One `step`:

    1. drain the inbox             4. launch: forward, verify, logprobs, propose (worker)
    2. apply aborts                5. collect the step's results and update (policy)
    3. schedule (policy)

The policy (`policy/`) knows no tensors; the worker (`worker/`) owns the device and crosses to the
host once per step.

Overlapped steps (`overlap_decode`): where the effects of the step just launched are known before
its results (`Policy.can_expect`), the policy counts them (`expect`) and plans the next step from
host state alone, which the worker launches at once: each sequence's last sampled token stays on
the device in the worker's token pool, and the next step's query takes it from there. Only then
does the core wait for the first step's readback and apply it. So the device runs step N + 1 while
the host reads, applies and hands on step N, and plans step N + 2. A sequence that finishes at step
N (a stop, EOS, an abort applied between steps) has computed one token too many in step N + 1,
which `update` drops.

Between steps (`between_steps.py`): controls (new weights, a pause, a memory release) run in a
step of their own, with nothing in flight, so no step mixes the state before them with the state
after; while a control drains the held requests or the core is paused, arrivals stay in the inbox.

Queue time (vLLM's `request_queue_time_seconds`) is measured here: from `add` until the first step
whose plan includes the request (its first prefill chunk).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from services.scheduler.between_steps import BetweenSteps, Control
from services.scheduler.plan import StepPlan
from services.scheduler.step_counts import QueueTimes, SchedulerStats, StepCounts, StepRecord, step_record
from services.scheduler.policy import Policy
from services.scheduler.request import RequestOutput, SchedulerRequest
from services.scheduler.worker import LaunchedStep, ModelWorker


class SchedulerCore:
    def __init__(
        self,
        worker: ModelWorker,
        policy: Policy,
        *,
        overlap_decode: bool = True,  # launch the next step before this one's readback (see above)
        clock: Callable[[], float] = time.monotonic,  # arrival and scheduling times (queue time)
    ) -> None:
        """A worker and a policy built for one runner (`build.assemble_core`)."""
        self.worker = worker
        self.policy = policy
        self.vocab_size = policy.config.vocab_size
        self.max_model_len = policy.config.max_model_len
        self.overlap_decode = overlap_decode
        self._lock = threading.Lock()
        self._inbox: list[SchedulerRequest] = []
        self._inbox_aborts: list[tuple[str, str]] = []
        self._inbox_arrivals: dict[str, float] = {}  # rid -> when `add` took it
        self._clock = clock
        self._queue_times = QueueTimes(clock)
        self._in_flight: LaunchedStep | None = None  # launched, results not applied yet (overlapped decoding)
        self._last_step: tuple | None = None  # (plan, followed, follows, collect_s, wait_s) of the last `step`, for `last_step`
        self.num_steps = 0
        self._counts = StepCounts(policy.config.num_draft_tokens)
        self.controls = BetweenSteps()  # `controls.add(Control)` from any thread

    # ---- thread-safe entry points ----

    def add(self, request: SchedulerRequest) -> None:
        with self._lock:
            self._inbox.append(request)
            now = self._clock()
            for rid in (request.rid, *(choice.rid for choice in request.choices)):  # forks: first scheduled apart
                self._inbox_arrivals[rid] = now

    def abort(self, rid: str, reason: str = "abort") -> None:
        with self._lock:
            self._inbox_aborts.append((rid, reason))

    def has_work(self) -> bool:
        with self._lock:
            if self.controls.pending:
                return True
            if self.controls.holds_arrivals:  # only aborts of requests already taken count
                waiting = {rid for request in self._inbox for rid in (request.rid, *(c.rid for c in request.choices))}
                inbox = any(rid not in waiting for rid, _ in self._inbox_aborts)
            else:
                inbox = bool(self._inbox or self._inbox_aborts)
        return inbox or self._in_flight is not None or (self.policy.has_work() and not self.controls.paused)

    @property
    def num_running(self) -> int:
        return self.policy.num_running + self.policy.num_waiting

    @property
    def num_preemptions(self) -> int:
        return self.policy.num_preemptions

    def rids(self) -> list[str]:
        return [seq.rid for seq in self.policy.held()]

    def claim_error(self, num_prompt_tokens: int) -> str | None:
        """Why a prompt of this length can never run here (what a claim knows); None when it can."""
        return self.policy.admission.length_error(num_prompt_tokens)

    def request_error(self, request: SchedulerRequest) -> str | None:
        """Why this core cannot run `request` (the policy's one admission check, then its grammar,
        compiled here off the step thread); None when it can."""
        return self.policy.admission.error(request) or self.worker.grammars.error(request.sampling.grammar)

    def has_room(self, num_prompt_tokens: int, num_claimed: int = 0, num_choices: int = 1) -> bool:
        """Load-aware placement: whether this core should take one more request (of `num_choices`
        forked choices) now; claimed requests whose GenerateRequest has not arrived count as held."""
        with self._lock:
            num_pending = len(self._inbox) + num_claimed
        return self.policy.has_room(num_prompt_tokens, num_pending, num_choices)

    @property
    def last_step(self) -> StepRecord | None:
        """What the last `step` ran (None: it planned nothing), summed only when asked: the step
        trace asks, the decode loop without one never pays for it."""
        return None if self._last_step is None else step_record(*self._last_step)

    def take_queue_times(self) -> dict[str, float]:
        """rid -> seconds from `add` until first scheduled, for requests first scheduled since the
        last call. Call between steps (the adapter: after each step)."""
        return self._queue_times.take()

    def stats(self) -> SchedulerStats:
        return self._counts.stats(self.policy, self.num_steps)

    def fail_all(self, message: str) -> list[RequestOutput]:
        """Finish every request held (inbox included) with ABORT: fatal errors and shutdown.

        Not thread-safe with `step`: call it only when no step runs.
        """
        self.controls.fail(message)
        requests, _ = self._drain_inbox()
        for request in requests:
            self.policy.add(request)
        held = [seq.rid for seq in self.policy.held()]
        self._in_flight = None  # its results are not wanted: every request it ran for ends here
        outputs = self.policy.fail_all(message)
        self.worker.release(held)
        self._queue_times.clear()
        return outputs

    # ---- the step ----

    @property
    def has_in_flight(self) -> bool:
        """A step is queued on the device behind the last one (`overlap_decode`): the next `step`
        collects it, so it launches something before it waits."""
        return self._in_flight is not None

    def step(self, on_queued: Callable[[], None] | None = None) -> list[RequestOutput]:
        """One step: its outputs. on_queued: called once the step's device work is queued (the next
        step's too, where it is planned ahead) and before it waits for the device, or at once when
        it queues none (`StepThread` hands the step before's outputs over there)."""
        self._last_step = None
        requests, aborts = self._drain_inbox()  # 1
        for request in requests:
            self.policy.add(request)
        for rid, reason in aborts:  # 2
            self.policy.abort(rid, reason)
        if self._in_flight is None and (self.controls.paused or self.controls.pending):
            control = self.controls.take(len(self.policy.held()))
            if control is not None or self.controls.paused:
                return self._idle(on_queued, control)
        launched, self._in_flight = self._in_flight, None
        followed = launched is not None
        if launched is None:
            plan = self.policy.schedule()  # 3
            self._queue_times.scheduled(plan)
            if not plan.steps:
                return self._idle(on_queued)
            launched = self.worker.launch(plan)  # 4
        if self.overlap_decode and not self.controls.pending and self.policy.can_expect(launched.plan):
            self._in_flight = self._launch_ahead(launched.plan)  # 3 and 4 of the next step
        if on_queued is not None:
            on_queued()
        collect_began = time.perf_counter()
        results = self.worker.collect(launched)  # 5
        collect_s = time.perf_counter() - collect_began
        outputs = self.policy.update(launched.plan, results)
        self._counts.count(launched.plan, results, outputs, self.worker)
        self._last_step = (launched.plan, followed, self._in_flight is not None, collect_s, self.worker.last_wait_s)
        self.num_steps += 1
        return self._finished(outputs)

    def _idle(self, on_queued: Callable[[], None] | None, control: Control | None = None) -> list[RequestOutput]:
        """A step that launches nothing: the outputs built so far (aborts), after `control`'s."""
        outputs: list[RequestOutput] = []
        if control is not None:
            try:
                outputs = control.run(self)
            except Exception as exc:  # the control's caller learns it; the core goes on as before
                control.done.set_exception(exc)
            else:
                control.done.set_result(len(outputs))
        if on_queued is not None:
            on_queued()
        self.num_steps += 1
        return self._finished([*outputs, *self.policy.take_outputs()])

    def _launch_ahead(self, plan: StepPlan) -> LaunchedStep | None:
        """The step after `plan`, planned from `plan`'s expected effects and launched behind it;
        None where there is nothing to launch or it would preempt (the next `step` plans it)."""
        self.policy.expect(plan)
        following = self.policy.schedule(ahead=True)
        if following is None or not following.steps:
            return None
        self._queue_times.scheduled(following)
        return self.worker.launch(following)

    def _drain_inbox(self) -> tuple[list[SchedulerRequest], list[tuple[str, str]]]:
        """Arrivals and aborts; while controls hold arrivals, those (and their aborts) stay."""
        with self._lock:
            aborts, self._inbox_aborts = self._inbox_aborts, []
            if self.controls.holds_arrivals:
                waiting = {rid for request in self._inbox for rid in (request.rid, *(c.rid for c in request.choices))}
                self._inbox_aborts = [abort for abort in aborts if abort[0] in waiting]
                return [], [abort for abort in aborts if abort[0] not in waiting]
            requests, self._inbox = self._inbox, []
            arrivals, self._inbox_arrivals = self._inbox_arrivals, {}
        self._queue_times.arrived(arrivals)
        return requests, aborts

    def _finished(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        finished = [o.rid for o in outputs if o.finish is not None]
        self.worker.release(finished)
        self._queue_times.forget(finished)
        return outputs
