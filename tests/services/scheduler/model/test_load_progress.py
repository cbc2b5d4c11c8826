"""Start-up progress of the model runtime: every tensor of a model load and every CUDA graph of
the capture ladder is counted (here as log records: no terminal under pytest)."""

from __future__ import annotations

import pytest
import torch
from structlog.testing import capture_logs

from services.common import progress
from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.graphs import DecodeGraphRunner
from services.scheduler.model.loader import load_model_runner


@pytest.fixture
def every_item(monkeypatch):
    monkeypatch.setattr(progress, "LOG_INTERVAL_S", 0.0)  # a record per item, not one per 5 s


def checkpoint_bytes(model) -> dict[str, int]:
    return {name: param.numel() * param.element_size() for name, param in model.checkpoint_tensors()}


@pytest.mark.parametrize("source", ["safetensors", "dummy", "seeded-random"])
def test_loading_reports_every_tensor_and_its_bytes(hf_model_dir, every_item, source) -> None:
    path = hf_model_dir("qwen3", True)[1] if source == "safetensors" else RANDOM_TINY_MODEL
    with capture_logs() as records:
        runner = load_model_runner(path, load_format="dummy" if source == "dummy" else "auto", num_kv_blocks=4)
    expected = checkpoint_bytes(runner.model)
    steps = [r for r in records if r["event"] == "model.load.progress"]
    assert sorted(r["tensor"] for r in steps) == sorted(expected)  # each tensor once
    assert [r["tensors"] for r in steps] == list(range(1, len(expected) + 1))
    assert all(r["num_tensors"] == len(expected) and r["total_bytes"] == sum(expected.values()) for r in steps)
    done = next(r for r in records if r["event"] == "model.load.done")
    assert (done["tensors"], done["bytes"]) == (len(expected), sum(expected.values()))
    assert done["model"] == "CausalLM"


def test_graph_capture_reports_every_rung_of_every_query_length(fake_cuda_capture, every_item) -> None:
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=8, cuda_graphs=False)
    ladder, query_lens = (1, 2, 4), (1, 3)
    with capture_logs() as records, torch.inference_mode():
        DecodeGraphRunner(runner.model, runner.kv_cache, ladder, 4, capture=True, use_kernel=False, query_lens=query_lens)
    steps = [r for r in records if r["event"] == "cuda_graphs.capture.progress"]
    assert sorted((r["rung"], r["query_len"]) for r in steps) == sorted((b, q) for b in ladder for q in query_lens)
    assert [r["graphs"] for r in steps] == list(range(1, 7)) and all(r["num_graphs"] == 6 for r in steps)
    assert [r for r in records if r["event"] == "cuda_graphs.capture.done"][0]["graphs"] == 6
