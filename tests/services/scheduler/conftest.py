"""Scheduler test fixtures: the bundled tiny model (CPU, fp32), loaded once per session.

Cores built on the shared runner each own their block manager; the runner's KV cache is only
scratch space that a core overwrites before reading, so sharing it between tests is safe as long
as tests do not step two cores at the same time.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from services.models import RANDOM_TINY_MODEL
from services.scheduler.build import core_for
from services.scheduler.core import SchedulerCore
from services.scheduler.model import ModelRunner, load_model_runner

NUM_KV_BLOCKS = 512
KV_BLOCK_SIZE = 16


@pytest.fixture(scope="session")
def tiny_runner() -> ModelRunner:
    return load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS, kv_block_size=KV_BLOCK_SIZE)


@pytest.fixture
def make_core(tiny_runner):
    def make(**overrides) -> SchedulerCore:
        options = {"max_running_requests": 64, "chunked_prefill_size": 256, "logprobs_mode": "raw", "seed": 0}
        options.update(overrides)
        return core_for(tiny_runner, **options)

    return make


@pytest.fixture
def fake_cuda_capture(monkeypatch):
    """What graph capture calls of torch.cuda, made no-ops: capture loops run on the CPU, eagerly
    (their progress and bookkeeping can be checked; the graphs replay nothing)."""

    class Graph:
        def pool(self):
            return None

        def replay(self):
            pass

    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", lambda graph, pool=None, **_: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
