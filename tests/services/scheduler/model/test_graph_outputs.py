"""Captured graphs hold one set of outputs per runner, not one per key (`graphs.SharedOutputs`).

A key's own outputs stay allocated for as long as its graph lives: at the Qwen3-8B shape under DSpark
(82 ragged prefill keys with five captured layers, 18 decode keys with f32 logits) that was ~4 GiB
the KV budget never left room for. The captures here run eagerly (`fake_cuda_capture`), keeping the
outputs a real capture keeps.
"""

from __future__ import annotations

import torch

from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.graphs import DecodeGraphRunner
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.ragged_graphs import RaggedGraphRunner

MAX_BLOCKS = 8
CAPTURE_LAYERS = (0, 1)


def held_bytes(outputs) -> int:
    """Bytes of the distinct storages the graphs' outputs keep alive."""
    storages = {}
    for out in outputs.values():
        for tensor in (out.hidden_states, out.captured, out.logits):
            if tensor is not None:
                storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
    return sum(storages.values())


def tiny_runner():
    return load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=64, kv_block_size=4, cuda_graphs=False)


def test_ragged_keys_share_one_set_of_outputs(fake_cuda_capture) -> None:
    runner = tiny_runner()
    graphs = RaggedGraphRunner(runner.model, runner.kv_cache, (1, 2, 4, 8), (8, 16, 32, 64), MAX_BLOCKS, capture=True,
                               use_kernel=False, capture_layers=CAPTURE_LAYERS)  # fmt: skip
    with torch.inference_mode():
        assert graphs.capture_prefill_keys() > 4
    config = runner.config
    row_bytes = (1 + len(CAPTURE_LAYERS)) * config.hidden_size * runner.dtype.itemsize  # hidden + captures
    assert held_bytes(graphs.outputs) == graphs.token_ladder[-1] * row_bytes  # the largest key's, once (not a sum over keys)


def test_decode_keys_share_one_logits_buffer(fake_cuda_capture) -> None:
    runner = tiny_runner()
    ladder, query_lens = (1, 2, 4, 8), (1, 4)
    with torch.inference_mode():
        graphs = DecodeGraphRunner(runner.model, runner.kv_cache, ladder, MAX_BLOCKS, capture=True, use_kernel=False,
                                   query_lens=query_lens)  # fmt: skip
    assert len(graphs.outputs) == len(ladder) * len(query_lens)
    logits = {out.logits.untyped_storage().data_ptr() for out in graphs.outputs.values()}
    assert len(logits) == 1  # every key's logits: rows of one f32 buffer
    assert held_bytes({0: graphs.outputs[(max(ladder), max(query_lens))]}) > graphs.shared.nbytes  # hidden states too
    assert graphs.shared.nbytes == max(ladder) * max(query_lens) * runner.config.vocab_size * 4
