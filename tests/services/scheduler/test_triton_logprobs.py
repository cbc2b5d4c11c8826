"""The fused raw-mode logprob kernels (`triton_logprobs.py`) against the torch path (`logprobs._gather`
of `_log_distribution`, the reference), in Triton's CPU interpreter (skipped without Triton; the
test extras install it): f32 and bf16 logits, several splits per row, k 0..20 with and without requested ids, rows built
with ties (at the top, across splits, at the k-th boundary, a flat row) and -inf columns; the prompt
path through a bf16 LM head in several chunks; `LogprobGraphs`' padded twin; and a whole core. Values
to 1e-6 (+1e-6 relative: one ulp of a logprob near -20 is 1.9e-6), ids exactly."""

from __future__ import annotations

import importlib.util

import numpy as np
import pytest
import torch

from services.scheduler.logprobs import (
    MAX_FUSED_K,
    LogprobQuery,
    TopKKeys,
    _chunk_rows,
    _gather,
    _log_distribution,
    logprob_columns,
    logprob_inputs,
    logprobs_on_device,
    runs_fused,
)
from test_logprob_graphs import _requests
from test_scheduler_core import run
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, interpreted, run_interpreted_cases, runs_the_interpreter

TOLERANCE = {"atol": 1e-6, "rtol": 1e-6}
VOCAB = 1500
BLOCK = 128  # 12 tiles a row: splits of several tiles, the last one short
CASES = [(0, 0), (0, 3), (1, 0), (2, 3), (5, 0), (20, 3)]  # (k, number of requested ids)


def tricky_logits(num_rows: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[num_rows, VOCAB], bf16-valued (many natural ties). Row 0: its max in the last split, tied with
    a column of the first, then five equal values spread over the splits (the 5th best falls among
    them); row 1 flat (every id tied); row 2 holds -inf columns."""
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(num_rows, VOCAB, generator=gen)).to(torch.bfloat16).float()
    logits[0, [VOCAB - 1, 4]] = 20.0
    logits[0, [VOCAB - 2, 700, 3, 130, 1000]] = 15.0
    if num_rows > 2:
        logits[1] = 0.5
        logits[2, [0, 9, 400, VOCAB - 1]] = float("-inf")
    return logits.to(dtype)


def row_inputs(num_rows: int, num_ids: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor | None]:
    gen = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, VOCAB, (num_rows,), generator=gen)
    ids = torch.randint(0, VOCAB, (num_rows, num_ids), generator=gen) if num_ids else None
    if num_rows > 2:  # row 2 asks for -inf columns' logprobs
        targets[2] = 9
        if ids is not None:
            ids[2, 0] = 400
    return targets, ids


def torch_columns(logits, targets, k, ids):
    return _gather(_log_distribution(logits.float(), None), targets, k, ids, TopKKeys.build(logits.shape[1], "cpu"))


def assert_columns_match(got, want) -> None:
    token, values, top_ids, requested = got
    assert token.dtype == values.dtype == requested.dtype == torch.float32 and top_ids.dtype == torch.int32
    for a, b in ((token, want[0]), (values, want[1]), (requested, want[3])):
        assert a.shape == b.shape
        torch.testing.assert_close(a, b, **TOLERANCE)
    assert top_ids.shape == want[2].shape and torch.equal(top_ids, want[2])


# ---- without the interpreter ----


def test_the_kernels_run_only_for_raw_rows_within_their_k_and_where_switched_on() -> None:
    assert runs_fused(True, False, MAX_FUSED_K) and runs_fused(True, False, 0)
    assert not runs_fused(True, True, 5)  # processed mode: the torch path
    assert not runs_fused(True, False, MAX_FUSED_K + 1)
    assert not runs_fused(False, False, 5)


@pytest.mark.skipif(INTERPRETED, reason="here a launch of the kernels must fail (no GPU, no interpreter)")
@pytest.mark.parametrize(("k", "sampling"), [(MAX_FUSED_K + 1, None), (5, {"temperature": torch.full((3,), 0.7)})])
def test_rows_the_kernels_do_not_take_stay_on_the_torch_path_with_the_switch_on(k, sampling) -> None:
    logits = tricky_logits(3, torch.float32)
    targets, ids = row_inputs(3, 3)
    keys = TopKKeys.build(VOCAB, "cpu")
    got = logprob_columns(logits, targets, k, ids, sampling, keys, fused=True)
    want = logprob_columns(logits, targets, k, ids, sampling, keys, fused=False)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_fused_prompt_chunks_hold_1024_bf16_rows_and_the_torch_path_keeps_its_f32_budget() -> None:
    vocab = 151936  # Qwen3-8B
    assert _chunk_rows(vocab, through_head=True, fused=True, model_bytes=2) == 1024  # 311 MB of bf16 logits
    assert _chunk_rows(vocab, through_head=True, fused=False, model_bytes=2) == 220  # 128 MiB of f32
    assert _chunk_rows(vocab, through_head=False, fused=True, model_bytes=2) == 883  # given f32 logits: CHUNK_BYTES


@pytest.mark.parametrize(("flag", "device", "passed"), [(True, "cuda", True), (False, "cuda", False), (True, "cpu", False)])
@pytest.mark.parametrize("greedy", [True, False])
def test_the_scheduler_flag_reaches_the_core_only_where_triton_runs(flag, device, passed, greedy, monkeypatch) -> None:
    from types import SimpleNamespace

    from services.scheduler import build
    from services.scheduler.config import SchedulerConfig

    class Built(Exception):
        pass

    def core(runner, settings, proposer=None, clock=None):
        raise Built(settings.worker.fused_logprobs)

    import sys

    runner = SimpleNamespace(device=torch.device(device), decode_kernel=False, ragged_kernel=False, num_blocks=64, block_size=16, batch_invariant=False,
                             config=SimpleNamespace(vocab_size=96), dtype=torch.bfloat16)  # fmt: skip
    warmed = []
    kernels = SimpleNamespace(warm_kernels=lambda vocab, on, dtypes, argmax: warmed.append((vocab, on.type, dtypes, argmax)))
    monkeypatch.setitem(sys.modules, "services.scheduler.triton_logprobs", kernels)  # no Triton needed
    monkeypatch.setattr(build, "load_model_runner", lambda path, **options: runner)
    monkeypatch.setattr(build, "assemble_core", core)
    monkeypatch.setattr(build, "triton_available", lambda: True)
    with pytest.raises(Built) as built:
        build.build_core(SchedulerConfig(device="cpu", fused_logprobs=flag, greedy_logprob_graphs=greedy))
    assert built.value.args == (passed,)
    # the kernels the core will run are compiled before it serves: f32 output rows, prompt rows in the
    # model's dtype, and greedy steps' f32 rows with their argmax
    argmax = (torch.float32,) if greedy else ()
    assert warmed == ([(96, "cuda", (torch.float32, torch.bfloat16), argmax)] if passed else [])


@interpreted
def test_interpreted_warm_up_runs_every_warm_k(monkeypatch) -> None:
    from services.scheduler import triton_logprobs

    calls = []
    original = triton_logprobs.raw_logprob_columns

    def recorded(logits, targets, k, ids, argmax_targets):
        calls.append((logits.dtype, tuple(logits.shape), k, argmax_targets))
        return original(logits, targets, k, ids, argmax_targets=argmax_targets)

    monkeypatch.setattr(triton_logprobs, "raw_logprob_columns", recorded)
    triton_logprobs.warm_kernels(50, torch.device("cpu"), (torch.float32, torch.bfloat16), (torch.float32,))
    variants = [(torch.float32, False), (torch.bfloat16, False), (torch.float32, True)]
    assert calls == [(dtype, (1, 50), k, argmax) for dtype, argmax in variants for k in triton_logprobs.WARM_KS]


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
@pytest.mark.parametrize("pointer", ["*bf16", "*fp32"])
def test_kernels_compile_for_the_h200(pointer) -> None:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler import triton_logprobs as kernels

    i32, f32 = "i32", "*fp32"
    common = {"logits_ptr": pointer, "max_ptr": f32, "sum_ptr": f32}
    scan = {"stride_row": i32, "vocab_size": i32, "tiles_per_split": i32}
    finish = {"cand_ptr": "*i64", "first_ptr": "*i32", "targets_ptr": "*i64", "ids_ptr": "*i64", "token_ptr": f32, "values_ptr": f32,
              "top_ids_ptr": "*i32", "requested_ptr": f32, "stride_row": i32, "num_ids": i32, "k": i32, "num_splits": i32}  # fmt: skip
    partial = {**common, "tile_max_ptr": f32, "first_ptr": "*i32", **scan, "num_splits": i32, "num_tiles": i32}
    specs = [
        *((kernels._partial_lse_kernel, partial, {"BLOCK": 1024, "ARGMAX": argmax}) for argmax in (False, True)),
        (kernels._candidates_kernel, {**common, "tile_max_ptr": f32, "cand_ptr": "*i64", **scan, "k": i32, "num_splits": i32,
                                      "num_tiles": i32}, {"SPLITS_PAD": 64, "BLOCK": 1024, "K_PAD": 32, "TILES_PAD": 256, "RANK_CHUNK": 32}),
        *((kernels._finish_kernel, {**common, **finish},
           {"SPLITS_PAD": 64, "K_PAD": 32, "CANDIDATES_PAD": 2048, "IDS_PAD": 4, "HAS_TOP_K": has, "ARGMAX": argmax})
          for has in (False, True) for argmax in (False, True)),
    ]  # fmt: skip
    for kernel, signature, constants in specs:
        source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        assert triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["cubin"], kernel


def test_the_compiled_layout_is_the_same_for_every_number_of_rows(monkeypatch) -> None:
    # The splits follow the rows, but what the kernels are compiled for (their constexprs) must not:
    # one compiled variant per k and ids width, not one per row count met while serving.
    pytest.importorskip("triton")
    from services.scheduler import triton_logprobs as kernels

    launched: dict[str, set] = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **constants):
                launched.setdefault(self.name, set()).add(tuple(sorted(constants.items())))
            return launch

    for name in ("_partial_lse_kernel", "_candidates_kernel", "_finish_kernel"):
        monkeypatch.setattr(kernels, name, Recorder(name))
    vocab = 151936
    for rows in (1, 2, 8, 64, 96, 128, 512):
        logits = torch.zeros(rows, vocab)
        kernels.raw_logprob_columns(logits, torch.zeros(rows, dtype=torch.int64), 20, None)
    assert set(launched) == {"_partial_lse_kernel", "_candidates_kernel", "_finish_kernel"}
    assert all(len(variants) == 1 for variants in launched.values()), launched


def test_split_layout_fills_the_gpu_for_one_row_and_uses_one_split_for_hundreds() -> None:
    pytest.importorskip("triton")
    from services.scheduler.triton_logprobs import MAX_CANDIDATES, split_layout

    vocab = 151936  # 75 tiles of 2048
    assert split_layout(1, vocab, 32) == (38, 2)  # 64 wanted, whole tiles: 38 splits of 2
    assert split_layout(64, vocab, 32) == (9, 9)  # 528 programs: 9 a row
    assert split_layout(512, vocab, 32) == (2, 38)
    assert split_layout(1024, vocab, 32) == (1, 75)
    splits, per_split = split_layout(1, vocab, 64)
    assert splits * 64 <= MAX_CANDIDATES and (splits - 1) * per_split < 75 <= splits * per_split


# ---- in the interpreter ----


@runs_the_interpreter
@pytest.mark.timeout(660)  # the child's own limit, and more: the suite's 120 s would cut it first
def test_logprob_kernels_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode (~38 s
    alone on a 2-core dev box; when it took 101 s, 120 s, the suite's limit, was hit with the box shared)."""
    run_interpreted_cases(__file__, timeout_s=600)


# One row at each split count in both dtypes; the many-rows grid (9 rows: the 3 of tricky_logits, 6
# random) in f32 only: the dtype changes nothing but the loads' upcast, which the one-row cases run in
# bf16 at the same splits (and bf16's flat and -inf rows run in the argmax test).
ROW_LAYOUTS = [(dtype, 1, splits) for dtype in (torch.float32, torch.bfloat16) for splits in (1, 3, 64)] + [(torch.float32, 9, 64)]


@interpreted
@pytest.mark.parametrize(("dtype", "num_rows", "max_splits"), ROW_LAYOUTS)
def test_interpreted_kernels_match_the_torch_path(dtype, num_rows, max_splits) -> None:
    from services.scheduler.triton_logprobs import raw_logprob_columns

    logits = tricky_logits(num_rows, dtype)
    for k, num_ids in CASES if num_rows == 1 else CASES[3::2]:  # 9 rows: (2, 3), (20, 3) (the interpreter is slow)
        targets, ids = row_inputs(num_rows, num_ids)
        got = raw_logprob_columns(logits, targets, k, ids, block=BLOCK, max_splits=max_splits)
        assert_columns_match(got, torch_columns(logits, targets, k, ids))
    if num_rows == 1:  # the tie rule: 20.0 at ids 4 and V - 1, then 15.0 at five ids by id
        assert got[2][0, :7].tolist() == [4, VOCAB - 1, 3, 130, 700, 1000, VOCAB - 2]


@interpreted
def test_interpreted_invariant_layout_gives_a_row_the_same_bits_alone_and_among_others() -> None:
    """--deterministic: a row's columns, computed alone and as one of 9 rows, are bitwise equal, where
    the default layout gives those two calls different split counts (so different reduction orders)."""
    from services.scheduler.triton_logprobs import raw_logprob_columns, split_layout

    k_pad = 32
    assert split_layout(1, VOCAB, k_pad, BLOCK, target_programs=27) != split_layout(9, VOCAB, k_pad, BLOCK, target_programs=27)
    logits = tricky_logits(9, torch.float32, seed=3)
    logits[3:] = torch.randn(6, VOCAB, generator=torch.Generator().manual_seed(4)) * 7  # not bf16-valued: rounding shows
    targets, ids = row_inputs(9, 3)
    many = raw_logprob_columns(logits, targets, 20, ids, block=BLOCK, target_programs=27, invariant=True)
    for row in (0, 5, 8):
        alone = raw_logprob_columns(logits[row : row + 1].clone(), targets[row : row + 1], 20, ids[row : row + 1],
                                    block=BLOCK, target_programs=27, invariant=True)  # fmt: skip
        for got, want in zip(alone, many, strict=True):
            assert torch.equal(got[0], want[row])


# One tile a split (3 rows x 47 splits: 141 programs a kernel, ~8 s interpreted on a 2-core box) in f32
# only: every logit here is bf16-valued, so bf16 changes only the loads' upcast, run at 16 tiles a split
# and at one split.
FLOOR_LAYOUTS = [(torch.float32, None), *((dtype, splits) for splits in (3, 1) for dtype in (torch.float32, torch.bfloat16))]


@interpreted
@pytest.mark.parametrize(("dtype", "max_splits"), FLOOR_LAYOUTS)
def test_interpreted_floor_from_the_tile_maxima_keeps_every_top_k_column(dtype, max_splits) -> None:
    # Tiles of 32 columns (47 a row, more than k): the candidates keep only columns at or above the
    # k-th largest tile maximum, and read only the tiles whose stored maximum reaches the k-th kept
    # (one tile a split, 16, or all 47 in one, screened as the k-th kept rises). Row 0: its 20 best
    # all in one tile (one tile max above the floor's tile). Row 1: 25 tiles whose maxima tie at the
    # 20th rank, and columns of other tiles equal to that value at smaller ids (they rank before the
    # tile maxima). Row 2: every logit equal.
    from services.scheduler.triton_logprobs import raw_logprob_columns

    logits = tricky_logits(3, torch.float32, seed=7).clamp(-8, 8)
    logits[0, 640:660] = 24.0 + torch.arange(20, dtype=torch.float32) / 8  # exact in bf16 too
    logits[1, torch.arange(25) * 32 + 31] = 12.0  # tile maxima, tied
    logits[1, [3, 35, 64]] = 12.0  # same value, smaller ids, tiles that already hold a 12.0
    logits[1, 1490] = 12.0
    logits[2] = 1.0
    logits = logits.to(dtype)
    top_ids = {}
    for k, num_ids in ((20, 3), (5, 0), (1, 0)):
        targets, ids = row_inputs(3, num_ids)
        got = raw_logprob_columns(logits, targets, k, ids, block=32, max_splits=max_splits)
        assert_columns_match(got, torch_columns(logits, targets, k, ids))
        top_ids[k] = got[2]
    assert top_ids[1][:, 0].tolist() == [659, 3, 0]
    top20 = top_ids[20]  # the requested ids' columns are gathers of their own: the top-k is the same without them
    assert top20[0].tolist() == list(range(659, 639, -1))
    assert top20[1].tolist() == [3, 31, 35, 63, 64, *(torch.arange(2, 17) * 32 + 31).tolist()]
    assert top20[2].tolist() == list(range(20))


def argmax_logits(dtype: torch.dtype) -> torch.Tensor:
    """`tricky_logits` (row 0: its max tied at ids 4 and V - 1, in the first and last split; row 1 flat;
    row 2 -inf columns) and two rows more: row 3 its max twice in one tile (ids 201 and 200 of tile 1)
    and once in a later split, after a smaller max in tile 0; row 4 its max once, in the last, short
    tile, behind -inf columns before it in that tile."""
    logits = torch.cat([tricky_logits(3, torch.float32), (2 * torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(4))).round()])
    logits[3, 17] = 30.0
    logits[3, [201, 200, 1300]] = 31.0
    logits[4, VOCAB - 40 : VOCAB - 5] = float("-inf")
    logits[4, VOCAB - 3] = 12.5
    return logits.to(dtype)


@pytest.mark.parametrize("k", [0, 20])
def test_the_torch_path_writes_each_rows_argmax_as_its_target(k) -> None:
    logits = argmax_logits(torch.float32)
    targets = torch.full((5,), -1, dtype=torch.int64)
    _, ids = row_inputs(5, 3)
    got = logprob_columns(logits, targets, k, ids, None, TopKKeys.build(VOCAB, "cpu"), fused=False, argmax_targets=True)
    assert targets.tolist() == [4, 0, logits[2].argmax().item(), 200, VOCAB - 3]
    assert_columns_match(got, torch_columns(logits, targets.clone(), k, ids))


# f32 at each split count; bf16 (every logit here bf16-valued: only the loads' upcast differs) at 3
# splits of 4 tiles, where ties fall within a tile, across tiles and across splits.
ARGMAX_LAYOUTS = [*((torch.float32, splits) for splits in (1, 3, 64)), (torch.bfloat16, 3)]


@interpreted
@pytest.mark.parametrize(("dtype", "max_splits"), ARGMAX_LAYOUTS)
def test_interpreted_argmax_targets_are_torch_argmax_and_the_columns_follow(dtype, max_splits) -> None:
    # The kernels take each row's argmax in their first pass (a greedy step's tokens): the first of
    # tied maxima within a tile, across tiles and across splits, as `torch.argmax` picks it.
    from services.scheduler.triton_logprobs import raw_logprob_columns

    logits = argmax_logits(dtype)
    want_targets = logits.argmax(dim=-1)
    assert want_targets.tolist()[:2] == [4, 0] and want_targets.tolist()[3:] == [200, VOCAB - 3]
    for k, num_ids in ((0, 0), (20, 3)):
        _, ids = row_inputs(5, num_ids)
        targets = torch.full((5,), -1, dtype=torch.int64)
        got = raw_logprob_columns(logits, targets, k, ids, block=BLOCK, max_splits=max_splits, argmax_targets=True)
        assert torch.equal(targets, want_targets)
        assert_columns_match(got, torch_columns(logits, want_targets, k, ids))


@interpreted
def test_interpreted_kernels_read_strided_rows_and_the_default_layout() -> None:
    from services.scheduler.triton_logprobs import raw_logprob_columns

    wide = tricky_logits(5, torch.float32, seed=3).repeat(1, 2)  # [5, 2V]: rows of the first half are strided
    logits = wide[:, :VOCAB]
    targets, ids = row_inputs(5, 3)
    assert_columns_match(raw_logprob_columns(logits, targets, 20, ids), torch_columns(logits, targets, 20, ids))


@interpreted
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interpreted_logits_of_each_dtype_default_to_tiles_of_2048_columns(dtype) -> None:
    from services.scheduler.triton_logprobs import BLOCK, raw_logprob_columns

    assert BLOCK == 2048
    logits = tricky_logits(3, dtype).repeat(1, 3)[:, : 2 * BLOCK + 300]  # three tiles, the last short; ties across them
    targets, ids = row_inputs(3, 3)
    for k in (2, 20):
        assert_columns_match(raw_logprob_columns(logits, targets, k, ids), torch_columns(logits, targets, k, ids))


@interpreted
def test_interpreted_prompt_rows_through_a_bf16_head_match_the_torch_path(monkeypatch) -> None:
    # 40 hidden rows, 29 asked for (a subset, out of order) in chunks of 8 rows: top-2 and requested ids.
    monkeypatch.setattr("services.scheduler.logprobs.FUSED_PROMPT_CHUNK_BYTES", 8 * 2 * VOCAB)
    gen = torch.Generator().manual_seed(5)
    hidden = torch.randn(40, 32, generator=gen).to(torch.bfloat16)  # [N, H]
    weight = torch.randn(VOCAB, 32, generator=gen).to(torch.bfloat16)  # [V, H]
    head = lambda rows: torch.nn.functional.linear(rows, weight)  # noqa: E731  [c, V] bf16, as runner.head_logits
    rng = np.random.default_rng(6)
    rows = rng.permutation(40)[:29].astype(np.int64)
    queries = [LogprobQuery(rows[:20], rng.integers(0, VOCAB, 20), 2, ()), LogprobQuery(rows[20:], rng.integers(0, VOCAB, 9), 1, (5, 77))]
    inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, False, 40).items()}
    keys = TopKKeys.build(VOCAB, "cpu")
    got = logprobs_on_device(queries, inputs, hidden, head, keys, False, fused=True)
    want = logprobs_on_device(queries, inputs, hidden, head, keys, False, fused=False)
    assert_columns_match(got.columns(), want.columns())


@interpreted
def test_interpreted_logprob_graphs_twin_with_the_kernels_matches_the_torch_path() -> None:
    # Padded rows (stale from the first call) go through the kernels too: every op is per row.
    from services.scheduler.logprob_graphs import LogprobGraphs

    keys = TopKKeys.build(VOCAB, "cpu")
    graphs = LogprobGraphs(keys, capture=False, fused=True)
    logits = tricky_logits(6, torch.float32)
    sampled = logits.argmax(dim=-1)
    for num_rows, k, ids in ((6, 20, (3, 9)), (3, 5, ())):
        queries = [LogprobQuery(np.arange(num_rows), None, k, ids)]
        inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, False, 6).items()}
        got = graphs.compute(queries, inputs, logits, False, sampled)
        want = logprobs_on_device(queries, inputs, logits, None, keys, False, sampled)
        assert_columns_match(got.columns(), want.columns())
    assert len(graphs._graphs) == 2  # one padded graph (here its eager twin) per key, the kernels' rows included
    # a greedy step's: the kernels' argmax is the step's tokens, and the rows follow from it
    queries = [LogprobQuery(np.asarray([i]), None, 20, (3, 9)) for i in range(6)]
    inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, False, 6).items()}
    tokens, rows = graphs.greedy(queries, inputs, logits, False)[:2]
    assert torch.equal(tokens, sampled)
    want = logprobs_on_device(queries, inputs, logits, None, keys, False, sampled)
    assert_columns_match(rows.columns(), want.columns())


@interpreted
def test_interpreted_core_with_the_kernels_serves_the_torch_cores_logprobs(make_core) -> None:
    # Prompt logprobs through `runner.head_logits`, output logprobs eager and from the graphs' twin.
    reqs = _requests(sampled=False)[:8]
    results = [run(make_core(chunked_prefill_size=40, logprob_graphs=graphs, fused_logprobs=fused), reqs)
               for graphs, fused in ((False, False), (True, True))]  # fmt: skip
    want = results[0]
    for got in results[1:]:
        assert set(got) == set(want)
        for rid, a in want.items():
            b = got[rid]
            assert a.tokens == b.tokens
            for name in ("input_top_ids", "output_top_ids"):
                if getattr(a, name):
                    np.testing.assert_array_equal(b.cat(name), a.cat(name), err_msg=f"{rid} {name}")
            for name in ("input_token", "input_top_values", "input_ids", "output_token", "output_top_values", "output_ids"):
                if getattr(a, name):
                    np.testing.assert_allclose(b.cat(name), a.cat(name), atol=1e-6, rtol=1e-6, err_msg=f"{rid} {name}")
