"""`sparkwire bench logprob-transport` end to end at a small size, so the benchmark cannot rot
(sizes and runtimes are `run`'s arguments; the command's own flags are parsed in test_cli.py)."""

from __future__ import annotations

import json

import pytest

from ops.bench.logprob_transport import HTTP_RUNTIMES, run


@pytest.mark.timeout(180)
def test_small_run_writes_every_figure(tmp_path):
    out = tmp_path / "logprob_transport.json"
    run(out, repeat=1, sizes=((256, 2),), http_runtimes=HTTP_RUNTIMES[:1])
    document = json.loads(out.read_text())
    (size,) = document["results"]
    assert (size["rows"], size["k"]) == (256, 2)
    assert size["flat_hop"]["bytes"] < size["nested_hop"]["bytes"]
    assert size["per_hop_speedup"] > 0  # a ratio of timings: how large is the benchmark's to say, not a test's
    for key in ("nested_two_hops_ms", "flat_two_hops_ms", "flat_two_hops_asyncio_ms"):
        assert size[key] > 0
    assert size["flat_one_hop"]["reader_ms"] > 0 and size["flat_one_hop"]["nats_py_ms"] > 0
    (figures,) = document["http_end_to_end"].values()
    assert figures["flat_b64_ms"] > 0 and figures["baseline_ms"] > 0
    processes = figures["flat_b64_per_request"]
    assert set(processes) == {"detokenizer", "tokenizer", "nats-server", "stand-in scheduler"}
    # /proc counts CPU in 10 ms ticks: one small request may read as 0, never as negative.
    assert all(p["cpu_ms"] >= 0 and p["page_faults"] >= 0 for p in processes.values())
