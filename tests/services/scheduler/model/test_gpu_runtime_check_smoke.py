"""The GPU runtime check script runs end to end on CPU with the bundled model."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


def load_script():
    spec = importlib.util.spec_from_file_location("gpu_runtime_check", REPO / "ops/bench/gpu_runtime_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_reports_each_config_and_survives_a_bad_one(tmp_path: Path, capsys) -> None:
    script = load_script()
    out = tmp_path / "check.json"
    argv = ["--device", "cpu", "--configs", str(REPO / "ops/models/sparkwire-tiny"), str(tmp_path / "missing"),
            "--batch-sizes", "1", "3", "--prefill-len", "20", "--decode-steps", "3", "--out", str(out)]
    assert script.main(argv) == 1  # the missing config fails, and says so
    results = json.loads(out.read_text())["configs"]
    assert [r["error"] is None for r in results] == [True, False]
    assert [b["batch_size"] for b in results[0]["batches"]] == [1, 3]
    assert all(b["decode_tok_s"] > 0 and b["decode_ms"]["eager_sdpa"] > 0 for b in results[0]["batches"])
    assert "| sparkwire-tiny |" in capsys.readouterr().out
    assert "| sparkwire-tiny |" in out.with_suffix(".md").read_text()
