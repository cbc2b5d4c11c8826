"""The tuned garbage collector (`memory.collector_tuned`) on the scheduler core's own decode steps."""

from __future__ import annotations

import subprocess
import sys

import pytest

# In a fresh interpreter: the core on the tiny model, 128 requests with top-20 output logprobs; the
# collector's runs counted over the decode steps after the first (the prefill's) and the service's
# publishing of each step's outputs (wire.to_token_batches).
DECODE_SCRIPT = """
import contextlib, gc, sys
import torch
from contracts.scheduler import LogprobParams, SamplingParams
from services.common import memory
from services.models import RANDOM_TINY_MODEL
from services.scheduler import wire
from services.scheduler.build import core_for
from services.scheduler.core import SchedulerCore
from services.scheduler.model import load_model_runner
from services.scheduler.request import SchedulerRequest

torch.set_num_threads(1)
tuned = sys.argv[1] == "tuned"
with memory.collector_tuned() if tuned else contextlib.nullcontext():
    runner = load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=640, kv_block_size=16)
    core = core_for(runner, max_running_requests=128, chunked_prefill_size=4096)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, ignore_eos=True)
    logprobs = LogprobParams(return_logprob=True, top_logprobs_num=20)
    for i in range(128):
        core.add(SchedulerRequest(f"r{i}", torch.randint(0, 1000, (16,), dtype=torch.int32).numpy(), "d", sampling, logprobs))
    wire.to_token_batches(core.step(), "s", 0)
    memory.settle_startup_heap()  # as the service does once ready (a no-op untuned)
    runs = [0]
    gc.callbacks.append(lambda phase, info: runs.__setitem__(0, runs[0] + (phase == "start")))
    steps = 0
    while core.has_work():
        wire.to_token_batches(core.step(), "s", steps)
        steps += 1
print(steps, runs[0])
"""


@pytest.mark.timeout(120)
def test_the_tuned_collector_runs_no_young_collection_in_a_top_20_decode_step_at_batch_128():
    """With CPython's threshold (700) a decode step of 128 requests with top-20 logprobs holds
    enough short-lived objects to set off a young collection about every other step (at batch 64
    it did almost every step before the requests' rows became `RowSpan`s); tuned, none runs: the
    step's objects are freed by their reference counts first."""
    counts = {}
    for mode in ("default", "tuned"):
        done = subprocess.run([sys.executable, "-c", DECODE_SCRIPT, mode], capture_output=True, text=True, check=True)
        steps, runs = map(int, done.stdout.split()[-2:])  # after the freeze's log line
        counts[mode] = (steps, runs)
    assert counts["default"][0] == counts["tuned"][0] == 39
    assert counts["default"][1] >= 20  # the control: one about every other step, or more
    assert counts["tuned"][1] == 0
