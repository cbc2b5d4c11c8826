"""A launched step's readback: which parts of the one device->host copy hold what, and the
per-sequence `SeqResult`s made of it; and the step's device time (`StepClock`)."""

from __future__ import annotations

import time

import numpy as np
import torch

from services.scheduler.host_io import HostReadback
from services.scheduler.logprob_graphs import GreedyRows
from services.scheduler.plan import SeqResult, StepPlan
from services.scheduler.worker.layout import StepLayout
from services.scheduler.worker.logprob_asks import LogprobJobs


class StepParts:
    """The readback's part of each thing a step brings back, as it is added."""

    def __init__(self, readback: HostReadback) -> None:
        self._readback = readback
        self.verified: tuple[int | None, int] | None = None  # (num_accepted's part, tokens')
        self.jobs: LogprobJobs | None = None
        self.prompt: list[int] | None = None
        self.output: list[int] | None = None
        self.drafts: int | None = None
        self.confidence: int | None = None

    def verify(self, num_accepted: torch.Tensor | None, tokens: torch.Tensor) -> None:
        accepted = None if num_accepted is None else self._readback.add(num_accepted)
        self.verified = (accepted, self._readback.add(tokens))

    def greedy(self, found: GreedyRows) -> None:
        """`LogprobGraphs.greedy`'s step: its tokens and output rows, views of one buffer, read back
        as that one part (instead of `verify` and `logprobs` adding each view)."""
        tokens, *self.output = self._readback.add_packed(found.packed, found.views)
        self.verified = (None, tokens)

    def logprobs(self, jobs: LogprobJobs) -> None:
        self.jobs = jobs
        if jobs.prompt_rows is not None:
            self.prompt = [self._readback.add(t) for t in jobs.prompt_rows.columns()]
        if jobs.output_rows is not None and self.output is None:  # `greedy`'s were added already
            self.output = [self._readback.add(t) for t in jobs.output_rows.columns()]

    def proposal(self, proposal) -> None:
        if proposal is None:
            return
        self.drafts = self._readback.add(proposal.tokens)
        if proposal.confidence is not None:
            self.confidence = self._readback.add(proposal.confidence.float())

    def results(self, plan: StepPlan, layout: StepLayout, host: list[np.ndarray]) -> list[SeqResult]:
        tokens: dict[int, list[int]] = {}
        if self.verified is not None:
            accepted, block = self.verified[0], host[self.verified[1]].tolist()
            num_accepted = [0] * len(block) if accepted is None else host[accepted].tolist()
            tokens = {i: block[p][: num_accepted[p] + 1] for p, i in enumerate(layout.producers)}
        prompt_rows, output_rows = self.jobs.host_rows(_parts(host, self.prompt), _parts(host, self.output))
        drafts = _per_producer(layout, host, self.drafts)
        confidence = _per_producer(layout, host, self.confidence)
        return [
            SeqResult(tokens.get(i, []), output_rows.get(i), prompt_rows.get(i), drafts.get(i, []), confidence.get(i))
            for i in range(len(plan.steps))
        ]


def _parts(host: list[np.ndarray], parts: list[int] | None) -> list[np.ndarray] | None:
    return None if parts is None else [host[p] for p in parts]


def _per_producer(layout: StepLayout, host: list[np.ndarray], part: int | None) -> dict[int, list]:
    if part is None:
        return {}
    rows = host[part].tolist()
    return {i: rows[p] for p, i in enumerate(layout.producers)}


class StepClock:
    """Marks inside a step: CUDA events (read once done, so never an extra sync), or the host clock
    on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks = [self._now()]

    def mark(self) -> None:
        self._marks.append(self._now())

    def done(self) -> bool:
        return not self._cuda or self._marks[-1].query()

    def intervals(self) -> list[float]:
        if self._cuda:
            return [a.elapsed_time(b) / 1e3 for a, b in zip(self._marks, self._marks[1:])]
        return [b - a for a, b in zip(self._marks, self._marks[1:])]

    def _now(self):
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event


class DeviceTimes:
    """(forward, draft) seconds of each collected step and of earlier ones that ended before their
    GPU work did: a step with nothing to read back (a prefill chunk that samples nothing) does not
    wait for the device, so its events are read by a later step, once done (the stream runs in order)."""

    def __init__(self) -> None:
        self.unread: list[StepClock] = []  # steps whose GPU work had not finished when they returned

    def read(self, clock: StepClock) -> tuple[float, float]:
        self.unread.append(clock)
        forward = draft = 0.0
        while self.unread and self.unread[0].done():
            step_forward, *step_draft = self.unread.pop(0).intervals()  # no draft mark without a proposer
            forward, draft = forward + step_forward, draft + sum(step_draft)
        return forward, draft
