"""`sparkwire bench reliability` end to end at a tiny size, so the command cannot rot (the full
run, with every fault and 256 streams, is the benchmark itself: ops/bench/results/)."""

from __future__ import annotations

import json

import pytest

from ops.bench.reliability import MUST_BE_ZERO, ReliabilityConfig, run


@pytest.mark.timeout(240)
def test_a_tiny_run_counts_every_request_and_fault(tmp_path):
    config = ReliabilityConfig(cases=("hostile_http", "hostile_nats", "concurrent"), num_concurrent=4,
                               num_in_flight=2, max_new_tokens=4, fault_tokens=16, nats_repeat=1)  # fmt: skip
    document = run(tmp_path / "reliability.json", config)
    assert json.loads((tmp_path / "reliability.json").read_text()) == json.loads(json.dumps(document, default=str))
    cases = document["cases"]
    assert set(cases) == {"hostile_http", "hostile_nats", "concurrent"}
    assert cases["hostile_http"]["failed_clearly"] == cases["hostile_http"]["sent"] > 40
    assert cases["hostile_nats"]["faults_injected"] == cases["hostile_nats"]["faults_survived"] > 30
    assert cases["concurrent"]["complete"] == 4
    assert document["must_be_zero"] == dict.fromkeys(MUST_BE_ZERO, 0) and document["passed"]
