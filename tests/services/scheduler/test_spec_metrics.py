"""Speculative decoding's numbers in the scheduler's /metrics: accept-length histogram, verify and draft time."""

from __future__ import annotations

from prometheus_client import generate_latest

from services.common.metrics_scheduler import SchedulerMetrics, SchedulerStats
from test_scheduler_core import run
from test_speculative_loop import GAMMA, OracleProposer, _plain, _requests


def test_accept_lengths_and_step_times_reach_the_exporter(make_core):
    requests = _requests(3)
    plain = _plain(make_core, requests)
    sequences = {r.rid: r.prompt_ids.tolist() + plain[r.rid].tokens for r in requests}
    core = make_core(proposer=OracleProposer(sequences, 2048))
    spec = run(core, requests)
    stats = core.stats()
    verifies = sum(r.spec_verify_ct for r in spec.values())
    assert sum(stats.accept_lengths) == verifies and len(stats.accept_lengths) == GAMMA + 2
    gained = sum(len(r.tokens) - 1 for r in spec.values())  # every token after the first came from a verify
    assert sum(n * c for n, c in enumerate(stats.accept_lengths)) >= gained  # whole blocks, cut by max_new_tokens
    assert stats.forward_s > 0 and stats.draft_s > 0
    snapshot = SchedulerStats(num_running=0, spec_accept_lengths=stats.accept_lengths, forward_seconds=stats.forward_s,
                              draft_seconds=stats.draft_s, num_spec_drafts=verifies)  # fmt: skip
    text = generate_latest(SchedulerMetrics(lambda: snapshot, "tiny").registry).decode()
    assert f'sparkwire:spec_decode_accept_length_count{{model_name="tiny"}} {float(verifies)}' in text
    assert "sparkwire:spec_decode_draft_seconds_total" in text and "sparkwire:spec_decode_verify_seconds_total" in text


class _Clock:
    """A step clock whose GPU work finishes when the test says (CUDA events stand-in)."""

    def __init__(self, forward: float, draft: float) -> None:
        self.finished, self.times = False, [forward, draft]

    def done(self) -> bool:
        return self.finished

    def intervals(self) -> list[float]:
        assert self.finished, "read before its events completed (CUDA raises here)"
        return self.times


def test_step_times_of_a_step_without_readback_are_read_once_done_by_a_later_step():
    """A prefill chunk that samples nothing reads nothing back, so the step ends before its GPU
    work: its events must wait for a later step (on CUDA, reading them early raises), and count once."""
    from services.scheduler.worker.readback import DeviceTimes

    times = DeviceTimes()  # the worker's clock bookkeeping
    chunk, decode = _Clock(2.0, 0.0), _Clock(0.5, 0.25)
    assert times.read(chunk) == (0.0, 0.0)  # not done: nothing read yet
    chunk.finished = decode.finished = True
    assert times.read(decode) == (2.5, 0.25)  # both steps, in stream order
    assert times.unread == []
    late = _Clock(1.0, 0.0)
    times.read(late)
    blocked = _Clock(3.0, 0.0)
    blocked.finished = True
    assert times.read(blocked) == (0.0, 0.0)  # in order: the earlier step is not done yet
