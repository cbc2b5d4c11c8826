"""`scheduler_harness`: its constants are the served defaults, and a stand-in's outputs reach the
wire as the scheduler's own do."""

from __future__ import annotations

import numpy as np

from contracts.detokenizer import Finish, FinishType
from ops.bench import scheduler_harness as harness
from services.common.arrays import from_wire
from services.common.logprob_rows import from_columns
from services.scheduler.config import SchedulerConfig


def test_the_constants_are_the_schedulers_defaults():
    config = SchedulerConfig()
    assert (harness.KV_BLOCK_SIZE, harness.CHUNKED_PREFILL_SIZE) == (config.kv_block_size, config.chunked_prefill_size)
    assert harness.MAX_PREFILL_TOKENS == SchedulerConfig(chunked_prefill_size=64).resolved_max_prefill_tokens


def test_stand_in_outputs_become_one_token_batch_per_detokenizer():
    top = (np.array([[-0.1, -2.0]], np.float32), np.array([[5, 9]], np.int32))  # [1, k]
    flat = (np.zeros((3, 2), np.float32), np.ones((3, 2), np.int32), 1)  # [rows, k], null prefix
    outputs = [harness.StandInOutput("a", "d0", [5], 4, Finish(FinishType.LENGTH), np.array([-0.1], np.float32), top,
                                     np.array([np.nan, -1, -1, -1], np.float32), flat),
               harness.StandInOutput("b", "d1", [7, 8], 3),
               harness.StandInOutput("c", "d0", [9], 3, output_logprobs=np.array([-0.5], np.float32))]  # fmt: skip
    batches = harness.token_batches(outputs, "standin", 7)
    assert sorted(batches) == ["d0", "d1"]
    d0, d1 = batches["d0"], batches["d1"]
    assert (d0.rids, d1.rids, d0.step) == (["a", "c"], ["b"], 7)
    assert d1.output_logprobs is None and d1.prompt_logprobs is None and d1.prompt_top_flat is None  # nobody there asked
    flat = from_columns(d0.prompt_top_flat, 2)[0]  # the flat prompt arrays travel as the scheduler sends them
    assert (flat.top_values.shape, flat.start) == ((3, 2), 1)
    assert from_wire(d0.output_logprobs.top_k).tolist() == [2, 0]  # top-2 for "a", none for "c"
