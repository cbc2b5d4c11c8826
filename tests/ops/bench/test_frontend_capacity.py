"""`sparkwire bench frontend-capacity` at a tiny size against the real detokenizer and tokenizer
behind the paced stand-in, so the benchmark cannot rot: every token arrives, the pace bounds the
rate, and the top-20 run carries its rows."""

from __future__ import annotations

import json

import pytest

from ops.bench.frontend_capacity import Load, table
from tests.ops.bench.bench_cli import bench


@pytest.mark.timeout(120)
def test_the_front_half_carries_every_token_under_the_paced_ceiling(tmp_path):
    load = Load(concurrency=4, step_ms=5.0, num_prompts=8, output_len=6)
    out = tmp_path / "frontend.json"
    assert bench("frontend-capacity", "--concurrency", load.concurrency, "--step-ms", load.step_ms, "--num-prompts", load.num_prompts,
                 "--output-len", load.output_len, "--out", out) == 0  # fmt: skip
    (result,) = json.loads(out.read_text())["runs"]["this tree"]
    plain, top = result["scenarios"]["plain"], result["scenarios"]["top20"]
    assert plain["failed"] == top["failed"] == 0
    for scenario in (plain, top):
        # nothing outruns the stand-in's pace (the rate over the run; a request's TPOT has no such floor:
        # its first token delivered late on a loaded machine shortens the span its TPOT divides)
        assert 0 < scenario["output_tok_s"] <= load.ceiling_tok_s * 1.05
        assert scenario["tpot_p50"] > 0
        assert scenario["cores"]["tokenizer-0"] > 0 and scenario["tokenizer_us_per_token"] > 0
    assert result["top20_cost"] is not None
    assert "| this tree | 1 | top20 |" in table({"this tree": [result]})
