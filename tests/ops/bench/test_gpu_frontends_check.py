"""`ops/bench/gpu_frontends_check.py` at toy size on CPU: one and two front ends serve every request."""

from __future__ import annotations

import argparse
import json

import pytest

from ops.bench.gpu_frontends_check import run
from services.models import BUNDLED_MODEL


@pytest.mark.timeout(180)
def test_one_and_two_front_ends_serve_every_request(tmp_path):
    out = tmp_path / "frontends.json"
    args = argparse.Namespace(model_config=BUNDLED_MODEL, device="cpu", concurrency=4, input_len=8, output_len=3, num_prompts=8,
                              repeats=1, no_core_baseline=True, out=out)  # fmt: skip
    run(args)
    result = json.loads(out.read_text())
    assert [r["front_ends"] for r in result["runs"]] == [1, 2]
    assert all(r["failed"] == 0 and r["output_throughput"] > 0 for r in result["runs"])
    assert len(result["runs"][1]["ttft_p50_ms"]) == 2  # one client per front end
    second = (tmp_path / "frontends_tokenizer2.log").read_text()
    assert second.count("request.finished") >= 4 + 2  # its half of the timed run and of the warm-ups
