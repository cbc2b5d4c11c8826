"""The decode path's CPU twins: paged decode attention, and the padded graph runner run eagerly.

On CUDA the same code runs the Triton kernel and replays captured graphs
(`sparkwire bench gpu-kernels fused` checks those against the eager path on a GPU); here CI checks
that the twins compute the unpadded eager forward, and that padding only ever writes the trash block.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.attention import paged_decode_attention_torch
from services.scheduler.model.graphs import DecodeGraphRunner, uniform_query_len
from services.scheduler.model.loader import load_model_runner

BLOCK_SIZE = 4
MAX_BLOCKS = 12


def dense_decode_reference(q, key_cache, value_cache, seq_lens, tables, scale):
    """Per sequence: gather its first seq_len keys block by block, SDPA in float64 with GQA repeat."""
    outs = []
    for b, seq_len in enumerate(seq_lens.tolist()):
        blocks = tables[b, : -(-seq_len // key_cache.shape[1])].long()
        k = key_cache[blocks].flatten(0, 1)[:seq_len].double().transpose(0, 1)  # [Hkv, L, D]
        v = value_cache[blocks].flatten(0, 1)[:seq_len].double().transpose(0, 1)
        repeats = q.shape[1] // k.shape[0]
        k, v = k.repeat_interleave(repeats, 0), v.repeat_interleave(repeats, 0)  # [Hq, L, D]
        outs.append(F.scaled_dot_product_attention(q[b].double()[:, None], k, v, scale=scale)[:, 0])
    return torch.stack(outs)  # [B, Hq, D]


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 2), (6, 2), (4, 4)])
def test_decode_attention_twin_matches_dense_reference_on_ragged_lengths(num_heads, num_kv_heads) -> None:
    gen = torch.Generator().manual_seed(num_heads * 10 + num_kv_heads)
    key_cache, value_cache = (torch.randn(40, BLOCK_SIZE, num_kv_heads, 16, generator=gen) for _ in range(2))
    seq_lens = torch.tensor([1, 4, 5, 17, 30], dtype=torch.int32)  # one block, full block, ragged
    tables = torch.randperm(40, generator=gen)[:40].view(5, 8).to(torch.int32)
    tables[0, 1:] = -1  # unused entries, as the scheduler pads them
    q = torch.randn(5, num_heads, 16, generator=gen)
    got = paged_decode_attention_torch(q, key_cache, value_cache, seq_lens, tables, 0.25)
    want = dense_decode_reference(q, key_cache, value_cache, seq_lens, tables, 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_uniform_query_len_routes_decode_verify_and_ragged_steps(make_pager) -> None:
    """q = 1 needs no host lengths (T == B); a uniform verify block needs them; ragged or long is None."""
    import dataclasses

    from services.scheduler.model.attention import MAX_BATCHED_QUERY_LEN

    pager = make_pager(num_seqs=2, max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE)

    def with_host_lens(chunks):
        return dataclasses.replace(pager.batch(chunks), host_query_lens=tuple(len(toks) for _, toks, _ in chunks))

    assert uniform_query_len(pager.batch([(0, [3], 5), (1, [4], 2)])) == 1
    assert uniform_query_len(with_host_lens([(0, [3, 4, 5], 5), (1, [4, 6, 7], 2)])) == 3
    assert uniform_query_len(pager.batch([(0, [3, 4, 5], 5), (1, [4, 6, 7], 2)])) is None  # no host lengths
    assert uniform_query_len(with_host_lens([(0, [3, 4], 5), (1, [4], 2)])) is None  # ragged
    long = list(range(MAX_BATCHED_QUERY_LEN + 1))
    assert uniform_query_len(with_host_lens([(0, long, 0), (1, long, 0)])) is None  # prefill chunks


def prefilled_runner(make_pager, lengths: list[int]):
    pager = make_pager(num_seqs=len(lengths), max_blocks_per_seq=MAX_BLOCKS, block_size=BLOCK_SIZE, seed=1)
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=pager.num_blocks, kv_block_size=BLOCK_SIZE)
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 2048, (n,), generator=gen).tolist() for n in lengths]
    runner.forward(pager.batch([(s, toks, 0) for s, toks in enumerate(prompts)]))
    return runner, pager


def decode_step(pager, lengths: list[int], seqs: list[int]):
    return pager.batch([(s, [11 + s], lengths[s]) for s in seqs])


@pytest.mark.parametrize("seqs", [[0, 1, 2], [4, 0, 3, 1, 2], [2]])  # pads 3 -> 4, 5 -> 8; 1 needs none
def test_graph_runner_twin_equals_unpadded_eager_forward(make_pager, seqs) -> None:
    lengths = [3, 9, 16, 1, 22]
    runner, pager = prefilled_runner(make_pager, lengths)
    batch = decode_step(pager, lengths, seqs)
    before = runner.kv_cache.kv.clone()
    eager = runner.forward(batch).hidden_states  # ragged SDPA path: the reference
    eager_kv = runner.kv_cache.kv.clone()
    runner.kv_cache.kv.copy_(before)
    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, (1, 2, 4, 8), MAX_BLOCKS, capture=False, use_kernel=False)
    with torch.inference_mode():
        padded = graphs.run(batch).hidden_states
    assert padded.shape == eager.shape
    torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
    real = slice(0, runner.num_blocks)  # every block but the trash block
    torch.testing.assert_close(runner.kv_cache.kv[:, :, real], eager_kv[:, :, real], atol=1e-5, rtol=1e-5)


def test_runner_routes_decode_through_graph_twin_and_verify_through_sdpa(make_pager) -> None:
    lengths = [5, 12, 2]
    runner, pager = prefilled_runner(make_pager, lengths)
    runner.prepare_decode_graphs(ladder=(2, 4), max_blocks_per_seq=MAX_BLOCKS, capture=False)
    assert runner.decode_graphs is not None and not runner.decode_graphs.graphs  # CPU: nothing captured
    kv = runner.kv_cache.kv.clone()
    decode = decode_step(pager, lengths, [0, 1, 2])
    routed = runner.forward(decode).hidden_states
    runner.kv_cache.kv.copy_(kv)
    runner.drop_decode_graphs()
    torch.testing.assert_close(routed, runner.forward(decode).hidden_states, atol=1e-5, rtol=1e-5)
    # A verify block (two tokens for one sequence) is not pure decode: same result either way.
    verify = pager.batch([(0, [11, 12], 5), (1, [13], 12)])
    runner.kv_cache.kv.copy_(kv)
    eager = runner.forward(verify).hidden_states
    runner.kv_cache.kv.copy_(kv)
    runner.prepare_decode_graphs(ladder=(2, 4), max_blocks_per_seq=MAX_BLOCKS, capture=False)
    torch.testing.assert_close(runner.forward(verify).hidden_states, eager, atol=0, rtol=0)


def test_too_wide_or_too_large_batches_fall_back(make_pager) -> None:
    lengths = [5, 12, 2]
    runner, pager = prefilled_runner(make_pager, lengths)
    graphs = DecodeGraphRunner(runner.model, runner.kv_cache, (1, 2), MAX_BLOCKS - 1, capture=False, use_kernel=False)
    assert not graphs.fits(decode_step(pager, lengths, [0, 1, 2]))  # 3 > largest rung
    assert not graphs.fits(decode_step(pager, lengths, [0]))  # table wider than the static buffer
    assert graphs.rung(1) == 1 and graphs.rung(2) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernel runs on CUDA only")
@pytest.mark.parametrize("query_len", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 7])  # 7: split-KV, some splits past the shorter sequences' blocks
def test_triton_kernel_matches_twin_on_cuda(query_len, num_splits) -> None:
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    key_cache, value_cache = (torch.randn(64, 16, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    seq_lens = torch.tensor([4, 16, 17, 190, 33], dtype=torch.int32, device="cuda")
    tables = torch.randperm(64, device="cuda")[:60].view(5, 12).to(torch.int32)
    q = torch.randn(5 * query_len, 32, 128, device="cuda", dtype=torch.bfloat16)
    args = (q, key_cache, value_cache, seq_lens, tables, 128**-0.5, query_len)
    torch.testing.assert_close(paged_block_attention_triton(*args, num_splits).float(), paged_decode_attention_torch(*args).float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("query_len", [2, 5])
def test_verify_attention_twin_is_causal_inside_each_block(query_len) -> None:
    gen = torch.Generator().manual_seed(query_len)
    key_cache, value_cache = (torch.randn(40, BLOCK_SIZE, 2, 16, generator=gen) for _ in range(2))
    seq_lens = torch.tensor([query_len, 9, 23], dtype=torch.int32)
    tables = torch.randperm(40, generator=gen)[:24].view(3, 8).to(torch.int32)
    q = torch.randn(3 * query_len, 4, 16, generator=gen)
    got = paged_decode_attention_torch(q, key_cache, value_cache, seq_lens, tables, 0.25, query_len)
    # token j of sequence b is a one-token decode of a sequence of length seq_len - (q - 1 - j)
    per_token_lens = torch.tensor([n - (query_len - 1 - j) for n in seq_lens.tolist() for j in range(query_len)], dtype=torch.int32)
    want = dense_decode_reference(q, key_cache, value_cache, per_token_lens, tables.repeat_interleave(query_len, 0), 0.25)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)


def test_graph_twin_runs_verify_blocks_with_captures_as_the_eager_forward(make_pager) -> None:
    import dataclasses

    lengths = [5, 12, 2]
    runner, pager = prefilled_runner(make_pager, lengths)
    kv = runner.kv_cache.kv.clone()
    block = [(b, [7 + b, 8 + b, 9 + b], lengths[b]) for b in range(3)]  # q = 3 tokens per sequence
    verify = dataclasses.replace(pager.batch(block, capture_layers=(0, 1)), host_query_lens=(3, 3, 3))
    eager = runner.forward(dataclasses.replace(verify, host_query_lens=None))
    runner.kv_cache.kv.copy_(kv)
    runner.prepare_decode_graphs(ladder=(2, 4), max_blocks_per_seq=MAX_BLOCKS, capture=False, query_lens=(1, 3), capture_layers=(0, 1))
    routed = runner.forward(verify)  # padded to the rung of 4, through the decode plan's twin
    torch.testing.assert_close(routed.hidden_states, eager.hidden_states, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(routed.captured, eager.captured, atol=1e-5, rtol=1e-5)
    runner.drop_decode_graphs()
