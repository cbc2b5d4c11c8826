"""`sparkwire bench gpu-prefix-cache` at toy size on the CPU (the bundled model), so the GPU run
cannot rot: both stacks come up, every scenario completes, the workloads have their shapes, and
the scheduler's counters say the cache-on stack found the shared prefixes (the cache-off one none)."""

from __future__ import annotations

import json

import pytest

from ops.bench.serve_workload import multi_turn_prompts, shared_prefix_prompts
from tests.ops.bench.bench_cli import bench

import numpy as np


def test_shared_prefix_and_multi_turn_workloads_have_their_shapes():
    pool = np.arange(10, 500)
    prompts = shared_prefix_prompts(4, 3, 32, 5, 7, pool, seed=0)
    assert len(prompts) == 12 and all(len(p.input_ids) == 37 and p.output_len == 7 for p in prompts)
    assert len({p.input_ids[:32] for p in prompts}) == 4 and len({p.input_ids for p in prompts}) == 12
    turns = multi_turn_prompts(2, 3, 10, 4, pool, seed=0)
    assert [len(t[0].input_ids) for t in turns] == [10, 24, 38]
    for before, after in zip(turns, turns[1:]):  # each turn's prompt starts with the one before
        assert all(b.input_ids == a.input_ids[: len(b.input_ids)] for b, a in zip(before, after))


@pytest.mark.timeout(300)
def test_every_scenario_runs_at_toy_size(tmp_path, capsys):
    out = tmp_path / "prefix.json"
    assert bench("gpu-prefix-cache", "--device", "cpu", "--tiny", "--out", out) == 0
    result = json.loads(out.read_text())
    for cache in ("on", "off"):
        scenarios = result[cache]["scenarios"]
        assert scenarios["shared_prefix"]["completed"] == 9 and scenarios["shared_prefix"]["failed"] == 0
        assert [t["prompt_len"] for t in scenarios["multi_turn"]["turns"]] == [16, 36, 56]
    assert set(result["on"]["scenarios"]["concurrency"]) == {"4", "8"} and "concurrency" not in result["off"]["scenarios"]
    assert {"shared_prefix_tok_s_on_over_off", "multi_turn_ttft_last_over_first", "wide_over_narrow_tok_s"} <= set(result["summary"])
    assert result["on"]["prefix_cache"]["shared_prefix"]["hits"] > 0 == result["off"]["prefix_cache"]["shared_prefix"]["hits"]
    assert result["on"]["prefix_cache"]["shared_prefix"]["queries"] == 9 * (48 + 8)
    assert "| shared_prefix | on | 9 / 0 |" in capsys.readouterr().out
