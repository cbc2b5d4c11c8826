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
