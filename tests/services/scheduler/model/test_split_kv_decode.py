"""Split-KV decode attention (`triton_decode.py`, num_splits > 1): the host-side split count
(`kv_splits.py`) and the plans that carry it, the runner's switch (on by default), and the kernels
against the torch twin in Triton's CPU interpreter (skipped without Triton; the test extras install it), plus a
compile-only check down to an sm_90 cubin. Speed is ops/bench/gpu_split_kv_check.py's, on the GPU."""

from __future__ import annotations

import importlib.util
import inspect

import pytest
import torch

from services.models import RANDOM_TINY_MODEL
from services.scheduler.model.attention import DecodePlan, paged_decode_attention, paged_decode_attention_torch
from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.kv_splits import MAX_SPLITS, num_kv_splits
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, interpreted, run_interpreted_cases, runs_the_interpreter

HAS_TRITON = importlib.util.find_spec("triton") is not None
TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
PAGE = 4
WIDTH = 12  # table entries per sequence


def split_runner(decode_kernel: bool = True, num_sms: int = 4) -> ModelRunner:
    """The tiny model (2 kv heads) on CPU with the decode kernel's plans, as if on `num_sms` SMs."""
    loaded = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=16, kv_block_size=PAGE)
    return ModelRunner(loaded.model, loaded.kv_cache, decode_kernel=decode_kernel, num_sms=num_sms)


def decode_batch(seq_lens: list[int]) -> ForwardBatch:
    """One new token per sequence; sequence b owns blocks 4b .. 4b + 3 (tables 4 wide)."""
    tables = torch.arange(len(seq_lens) * 4, dtype=torch.int32).view(len(seq_lens), 4)  # [B, 4]
    last = torch.tensor(seq_lens) - 1  # [B]
    slots = tables[torch.arange(len(seq_lens)), last // PAGE].long() * PAGE + last % PAGE  # [B]
    return ForwardBatch(
        input_ids=torch.arange(3, 3 + len(seq_lens)), positions=last, query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), block_tables=tables, slot_mapping=slots,
    )  # fmt: skip


def test_split_kv_is_on_by_default_everywhere_it_is_set() -> None:
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.flags import CUDA_SWITCHES

    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=8, kv_block_size=PAGE)
    assert runner.split_kv_decode is True and SchedulerConfig().split_kv_decode is True
    assert CUDA_SWITCHES["split-kv-decode"][0] is True
    assert runner.split_sms == 0  # CPU without the kernel: never split


def test_plans_take_their_split_count_from_host_shapes() -> None:
    # 4 SMs x 2 programs over 2 kv heads: 3 sequences want 2 splits, 1 sequence 4 (4-wide tables)
    runner = split_runner()
    eager = runner.decode_plan(decode_batch([5, 9, 2]), 1)
    assert eager.num_kv_splits == 2 and type(eager.num_kv_splits) is int
    assert runner.decode_plan(decode_batch([5]), 1).num_kv_splits == 4
    runner.prepare_decode_graphs(ladder=(1, 3), max_blocks_per_seq=4, capture=False)
    graphs = runner.decode_graphs
    assert graphs.split_sms == 4 and [graphs.plan(rung, 1).num_kv_splits for rung in (1, 3)] == [4, 2]
    assert type(graphs.plan(3, 1).num_kv_splits) is int


@pytest.mark.parametrize(("split", "decode_kernel"), [(False, True), (True, False)])
def test_no_split_with_split_kv_off_or_without_the_kernel(split, decode_kernel) -> None:
    runner = split_runner(decode_kernel=decode_kernel)
    runner.split_kv_decode = split
    assert runner.split_sms == 0 and runner.decode_plan(decode_batch([5]), 1).num_kv_splits == 1
    runner.prepare_decode_graphs(ladder=(1,), max_blocks_per_seq=4, capture=False)
    assert runner.decode_graphs.plan(1, 1).num_kv_splits == 1


def test_the_split_switch_refuses_to_change_under_decode_graphs() -> None:
    runner = load_model_runner(RANDOM_TINY_MODEL, num_kv_blocks=8, kv_block_size=PAGE)
    runner.prepare_decode_graphs(ladder=(1,), max_blocks_per_seq=2, capture=False)
    with pytest.raises(RuntimeError, match="drop them first"):
        runner.split_kv_decode = False
    runner.split_kv_decode = True  # no change: allowed
    runner.drop_decode_graphs()
    runner.split_kv_decode = False
    assert runner.split_kv_decode is False


@pytest.mark.parametrize("flag", [False, True])
def test_the_scheduler_flag_reaches_the_loader(flag, monkeypatch) -> None:
    from services.scheduler.config import SchedulerConfig
    from tests.services.scheduler.loader_options import loader_options

    assert loader_options(monkeypatch, SchedulerConfig(device="cpu", split_kv_decode=flag))["split_kv_decode"] is flag


@pytest.mark.parametrize(
    ("num_seqs", "num_kv_heads", "max_blocks", "num_sms", "wanted"),
    [
        (1, 8, 2560, 132, 32),  # 8B / 0.6B at batch 1: 33 wanted for 264 programs, MAX_SPLITS caps it
        (4, 8, 2560, 132, 9),  # 264 / 32 programs
        (32, 8, 2560, 132, 2),
        (33, 8, 2560, 132, 1),  # the batch alone gives 264 programs
        (64, 8, 2560, 132, 1),
        (1, 8, 3, 132, 3),  # no more splits than table entries
        (1, 1, 1, 132, 1),
    ],
)
def test_num_kv_splits_comes_from_shapes_alone(num_seqs, num_kv_heads, max_blocks, num_sms, wanted) -> None:
    assert list(inspect.signature(num_kv_splits).parameters) == ["num_seqs", "num_kv_heads", "max_blocks", "num_sms"]
    assert num_kv_splits(num_seqs, num_kv_heads, max_blocks, num_sms) == wanted


@runs_the_interpreter
def test_split_kv_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode."""
    run_interpreted_cases(__file__)


def decode_inputs(seq_lens: list[int], query_len: int, num_padded: int, num_heads: int = 8, num_kv_heads: int = 2):
    """(query [T, Hq, D], key cache, value cache, seq_lens, tables) on shuffled blocks, then
    `num_padded` rows padded as the graph runner pads them: seq_len q, every entry the trash block
    (the cache's last), whose slots hold values of their own."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + query_len)
    num_blocks = len(seq_lens) * WIDTH + 1
    trash = num_blocks - 1
    key_cache, value_cache = (torch.randn(num_blocks, PAGE, num_kv_heads, 16, generator=gen) for _ in range(2))
    tables = torch.randperm(trash, generator=gen).view(len(seq_lens), WIDTH)
    tables = torch.cat([tables, torch.full((num_padded, WIDTH), trash)]).to(torch.int32)  # [B, M]
    lens = torch.tensor(seq_lens + [query_len] * num_padded, dtype=torch.int32)  # [B]
    query = torch.randn(len(lens) * query_len, num_heads, 16, generator=gen)  # [B * q, Hq, D]
    return query, key_cache, value_cache, lens, tables


# one key; ragged lengths (not multiples of PAGE, one that is); a split count past some sequences' blocks
CASES = [([1], 1), ([1, 6, 8, 23, 45], 1), ([8, 13, 16, 30, 45], 8), ([9], 8)]


@interpreted
@pytest.mark.parametrize("num_splits", [1, 2, 7])
@pytest.mark.parametrize(("seq_lens", "query_len"), CASES)
def test_interpreted_split_kernel_matches_twin(seq_lens, query_len, num_splits) -> None:
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    args = (*decode_inputs(seq_lens, query_len, num_padded=2), 0.25, query_len)  # GQA 4:1
    got = paged_block_attention_triton(*args, num_splits)
    torch.testing.assert_close(got, paged_decode_attention_torch(*args), **TOLERANCE)


def recorded_splits(monkeypatch) -> list[int]:
    """The num_splits of every decode kernel call from here on; the device is never asked for its SMs."""
    from services.scheduler.model import triton_decode

    calls, kernel = [], triton_decode.paged_block_attention_triton

    def counted(*args, **options):
        calls.append(args[-1])  # num_splits, the last positional argument
        return kernel(*args, **options)

    def no_device(device):
        raise AssertionError("attention read the device's properties")

    monkeypatch.setattr(triton_decode, "paged_block_attention_triton", counted)
    monkeypatch.setattr(torch.cuda, "get_device_properties", no_device)
    return calls


@interpreted
def test_interpreted_decode_attention_runs_the_plans_split_count(monkeypatch) -> None:
    calls = recorded_splits(monkeypatch)
    query, key_cache, value_cache, lens, tables = decode_inputs([5, 30], 1, num_padded=1)
    plan = DecodePlan(lens, tables, use_kernel=True, num_kv_splits=3)
    got = paged_decode_attention(query, key_cache, value_cache, plan, 0.25)
    want = paged_decode_attention_torch(query, key_cache, value_cache, lens, tables, 0.25)
    torch.testing.assert_close(got, want, **TOLERANCE)
    assert calls == [3]


@interpreted
def test_interpreted_eager_decode_step_splits_every_layer_as_planned(monkeypatch) -> None:
    runner = split_runner()  # 3 sequences: 2 splits (test_plans_take_their_split_count_from_host_shapes)
    runner.kv_cache.kv.normal_(generator=torch.Generator().manual_seed(1))
    calls = recorded_splits(monkeypatch)
    batch = decode_batch([5, 9, 2])
    split = runner.forward(batch).hidden_states
    runner.split_kv_decode = False
    whole = runner.forward(batch).hidden_states  # rewrites the same K/V into the same slots
    assert calls == [2] * runner.config.num_hidden_layers + [1] * runner.config.num_hidden_layers
    torch.testing.assert_close(split, whole, **TOLERANCE)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize(("query_len", "window", "softcap"), [(1, 0, 0.0), (8, 0, 0.0), (8, 4096, 50.0)])
def test_decode_kernels_compile_for_the_h200_at_the_8b_shape(query_len, window, softcap) -> None:
    # The interpreter runs the kernels' Python; this runs Triton's compiler down to an sm_90 cubin (no
    # device needed), so what only the compiler refuses (types across branches, layouts) fails here.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_decode

    bf16, f32, i32 = "*bf16", "*fp32", "i32"
    inputs = {"q_ptr": bf16, "k_ptr": bf16, "v_ptr": bf16}
    tables = {"seq_lens_ptr": "*i32", "tables_ptr": "*i32", "scale": "fp32"}
    strides = dict.fromkeys(["stride_qt", "stride_qh", "stride_kb", "stride_ks", "stride_kh"], i32)
    partials = {"max_ptr": f32, "sum_ptr": f32, "acc_ptr": f32}
    block = {**inputs, "out_ptr": bf16, **tables, **strides, "stride_ot": i32, "stride_oh": i32, "stride_tb": i32}
    split = {**inputs, **partials, **tables, "num_heads": i32, "num_splits": i32, **strides, "stride_tb": i32}
    combine = {**partials, "out_ptr": bf16, "num_heads": i32, "num_splits": i32, "stride_ot": i32, "stride_oh": i32}
    shape = {"GROUP": 4, "QUERY_LEN": query_len, "ROWS": triton_decode.tile_rows(query_len, 4), "HEAD_DIM": 128,
             "BLOCK_SIZE": 16, "WINDOW": window, "SOFTCAP": softcap}
    kernels = [
        (triton_decode._paged_block_kernel, block, shape),
        (triton_decode._paged_split_kernel, split, shape),
        (triton_decode._combine_splits_kernel, combine, {"HEAD_DIM": 128, "SPLITS": MAX_SPLITS}),
    ]
    for kernel, signature, constants in kernels:
        source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel
