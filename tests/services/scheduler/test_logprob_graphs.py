"""`LogprobGraphs` on the CPU (its padded eager twin; capture=False) equals `logprobs_on_device` bit
for bit: mixed k and ids, ties, row subsets, stale padded rows, raw and processed modes; and a core
with logprob graphs serves the eager core's tokens and logprobs exactly (plain and DSpark)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from contracts.scheduler import LogprobParams, SamplingParams
from services.scheduler.logprob_graphs import LogprobGraphs
from services.scheduler.logprobs import LogprobQuery, TopKKeys, logprob_inputs, logprobs_on_device, split_logprobs
from test_dspark_core import dspark  # noqa: F401  (fixture)
from test_scheduler_core import prompt_of, request, run

VOCAB = 300
SAMPLINGS = [
    SamplingParams(),
    SamplingParams(temperature=0.7, top_k=7),
    SamplingParams(temperature=1.3, top_p=0.8),
    SamplingParams(temperature=0.0, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.9, min_p=0.01),
]


def _logits(num_rows: int, seed: int) -> torch.Tensor:
    """f32 [N, V], rounded to few values so rows hold many ties (at the k-th value too)."""
    generator = torch.Generator().manual_seed(seed)
    return (2 * torch.randn(num_rows, VOCAB, generator=generator)).round(decimals=1)


def _queries(rows_each: list[int], ks: list[int], ids: list[tuple[int, ...]], samplings, source_rows: int, seed: int):
    rng = np.random.default_rng(seed)
    picked = rng.permutation(source_rows)[: sum(rows_each)]
    bounds = np.cumsum([0, *rows_each])
    return [
        LogprobQuery(picked[a:b].astype(np.int64), None, k, m, s)
        for a, b, k, m, s in zip(bounds[:-1], bounds[1:], ks, ids, samplings, strict=True)
    ]


def _both(graphs: LogprobGraphs, queries, logits, processed: bool, sampled):
    keys = graphs.keys
    inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, processed, logits.shape[0]).items()}
    want = logprobs_on_device(queries, inputs, logits, None, keys, processed, sampled)
    got = graphs.compute(queries, inputs, logits, processed, sampled)
    return want, got


def _assert_equal(want, got, queries) -> None:
    for a, b in zip(want.columns(), got.columns(), strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b)
    split_want = split_logprobs(queries, [t.numpy() for t in want.columns()])
    split_got = split_logprobs(queries, [t.contiguous().numpy() for t in got.columns()])
    for a, b in zip(split_want, split_got, strict=True):
        for x, y in zip(a.columns(), b.columns(), strict=True):
            np.testing.assert_array_equal(x, y)


CASES = [  # rows per request, k, requested ids: shapes that land on and between the ladders' rungs
    ([1], [20], [()]),
    ([1] * 7, [20, 0, 5, 1, 20, 3, 2], [(), (4, 9), (), (1, 2, 3, 4, 5), (), (299,), ()]),
    ([4, 4, 4], [5, 5, 5], [(7,), (7,), (7,)]),
    ([5, 2, 8, 1], [0, 0, 0, 0], [(), (), (), ()]),
    ([8] * 12, [20] * 12, [()] * 12),
]


@pytest.mark.parametrize("processed", [False, True])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_padded_twin_equals_the_eager_path_bit_for_bit(processed, case):
    rows_each, ks, ids = CASES[case]
    samplings = [SAMPLINGS[i % len(SAMPLINGS)] for i in range(len(ks))]
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=False)
    logits = _logits(120, seed=case)
    sampled = torch.randint(0, VOCAB, (120,), generator=torch.Generator().manual_seed(case))
    queries = _queries(rows_each, ks, ids, samplings, 120, seed=case)
    _assert_equal(*_both(graphs, queries, logits, processed, sampled), queries)


@pytest.mark.parametrize("processed", [False, True])
def test_stale_padded_rows_and_ids_columns_change_nothing(processed):
    """Calls on one key with fewer rows and ids each time: rows and columns past them hold the last call's."""
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=False)
    for seed, (num_rows, ids) in enumerate(((7, (1, 2, 3, 4)), (5, (9, 8, 7)), (6, (3, 5, 6)), (8, (5, 6, 2, 1)))):
        logits = _logits(40, seed=10 + seed)
        sampled = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(seed))
        samplings = [SAMPLINGS[(seed + i) % len(SAMPLINGS)] for i in range(num_rows)]
        queries = _queries([1] * num_rows, [20] * num_rows, [ids] * num_rows, samplings, 40, seed=seed)
        _assert_equal(*_both(graphs, queries, logits, processed, sampled), queries)
    assert len(graphs._graphs) == 1  # rows rung 8, ids rung 4


def test_every_source_row_given_targets_and_keys_off_the_ladders():
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=False, max_rows=16)
    logits = _logits(24, seed=3)
    targets = np.arange(24, dtype=np.int64) * 7 % VOCAB
    whole = [LogprobQuery(np.arange(12, dtype=np.int64) + 12 * i, targets[12 * i : 12 * (i + 1)], 3, ()) for i in range(2)]
    for queries in (whole[:1], whole, [LogprobQuery(np.arange(3), None, 25, ())], [LogprobQuery(np.arange(2), None, 1, tuple(range(17)))]):
        sampled = torch.arange(24) % VOCAB
        _assert_equal(*_both(graphs, queries, logits, False, sampled if queries[0].targets is None else None), queries)
    assert len(graphs._graphs) == 1  # 12 rows: one graph; 24 rows (> max_rows), k = 25 and 17 ids: eager


def test_past_max_graphs_keys_run_eagerly():
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=False, max_graphs=2)
    logits, sampled = _logits(64, seed=4), torch.arange(64) % VOCAB
    for num_rows in (1, 2, 4, 8, 16):
        queries = [LogprobQuery(np.arange(num_rows), None, 5, ())]
        _assert_equal(*_both(graphs, queries, logits, False, sampled), queries)
    assert len(graphs._graphs) == 2


def test_capture_bookkeeping(fake_cuda_capture):
    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=True)
    logits, sampled = _logits(16, seed=5), torch.arange(16)
    for num_rows in (1, 3, 4, 3):
        queries = [LogprobQuery(np.arange(num_rows), None, 20, ())]
        got = graphs.compute(queries, {}, logits, False, sampled)
        assert got.top_values.shape == (num_rows, 20)
    assert graphs.num_captured == 2 and graphs.capture_s > 0  # rungs 1 and 4


MIXED = [
    None,
    LogprobParams(return_logprob=True, top_logprobs_num=20),
    LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999)),
    LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=2),
    LogprobParams(return_logprob=True, top_logprobs_num=0, token_ids_logprob=(11,)),
]


def _requests(sampled: bool) -> list:
    extra = [dict(temperature=0.8, seed=7, top_k=9), dict(temperature=1.1, seed=3, top_p=0.7, min_p=0.02), {}] if sampled else [{}]
    return [
        request(f"r{i}", prompt_of(500 + i, 3 + 2 * i), max_new_tokens=3 + i % 5, ignore_eos=True,
                logprobs=MIXED[i % len(MIXED)], **extra[i % len(extra)])  # fmt: skip
        for i in range(14)
    ]


def _assert_exact(eager, graphed) -> None:
    assert set(eager) == set(graphed)
    for rid, a in eager.items():
        b = graphed[rid]
        assert a.tokens == b.tokens and a.finish == b.finish
        for name in ("input_token", "input_top_values", "input_top_ids", "input_ids",
                     "output_token", "output_top_values", "output_top_ids", "output_ids"):  # fmt: skip
            if getattr(a, name):
                np.testing.assert_array_equal(b.cat(name), a.cat(name), err_msg=f"{rid} {name}")


@pytest.mark.parametrize("mode", ["raw", "processed"])
@pytest.mark.parametrize("speculative", [False, True])
def test_core_with_logprob_graphs_serves_the_eager_cores_logprobs_exactly(make_core, dspark, mode, speculative):  # noqa: F811
    reqs = _requests(sampled=mode == "processed")
    joins = {2: reqs[10:]}
    results = []
    for graphs in (False, True):
        proposer = dspark() if speculative else None
        core = make_core(chunked_prefill_size=40, logprobs_mode=mode, proposer=proposer, logprob_graphs=graphs)
        results.append(run(core, reqs[:10], joins))
        assert (core.worker.logprob_graphs is not None) == graphs
    _assert_exact(*results)
    assert core.worker.logprob_graphs._graphs  # the graphs' twin served the output rows


@pytest.mark.parametrize("processed", [False, True])
def test_a_replayed_call_launches_only_the_copies_into_its_static_inputs(fake_cuda_capture, processed):
    """Host cost of a replay: one copy per input (logits rows, targets, ids, each sampling input), whatever
    the number of requests, plus views; the graph's own ops (replayed by the fake as nothing) are not run."""
    from ops.bench.logprob_ops import OpCounter

    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=True)
    logits, sampled = _logits(64, seed=6), torch.arange(64) % VOCAB
    queries = _queries([1] * 9, [20, 5] * 4 + [0], [(3, 4), ()] * 4 + [(1,)], SAMPLINGS + SAMPLINGS[:4], 64, seed=6)
    inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, processed, 64).items()}
    graphs.compute(queries, inputs, logits, processed, sampled)  # captures
    with OpCounter() as counter:
        graphs.compute(queries, inputs, logits, processed, sampled)
    copies = 3 + 4 * processed  # logits, targets, ids; temperature, top_k, top_p, min_p
    assert counter.num_kernels == copies and graphs.num_captured == 1


# ---- greedy: a plain greedy decode graph step's tokens and rows from one graph over its logits ----


@pytest.mark.parametrize("processed", [False, True])
def test_greedy_equals_compute_given_the_argmax_bit_for_bit(processed):
    """Each call: a source of R rows (a decode rung), n <= R of them the step's, every one asking (in
    order, no targets); tokens are the rows' argmax, the rows equal `compute`'s given those tokens, and
    the padding past n rows and past the asked k and ids is never what the split reads."""
    keys = TopKKeys.build(VOCAB, "cpu")
    graphs, reference = LogprobGraphs(keys, capture=False), LogprobGraphs(keys, capture=False)
    cases = [(1, 1, [20], [()]), (4, 3, [20, 5, 0], [(3, 4), (), (299,)]), (4, 4, [3] * 4, [(1, 2, 3)] * 4), (8, 5, [1] * 5, [()] * 5)]
    for seed, (rows, n, ks, ids) in enumerate(cases):
        source = _logits(rows, seed=20 + seed)
        samplings = [SamplingParams(temperature=0.0)] * n if not processed else [SAMPLINGS[i % 4] for i in range(n)]
        queries = [LogprobQuery(np.asarray([i], np.int64), None, k, m, s) for i, (k, m, s) in enumerate(zip(ks, ids, samplings))]
        inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, processed, n).items()}
        assert "rows" not in inputs and "targets" not in inputs
        tokens, got = graphs.greedy(queries, inputs, source, processed)[:2]
        assert tokens.shape == (rows,) and torch.equal(tokens, source.argmax(dim=-1))
        want = reference.compute(queries, inputs, source[:n], processed, tokens[:n].clone())
        assert got.token.shape[0] == rows and got.top_values.shape[1] >= want.top_values.shape[1]
        split_want = split_logprobs(queries, [t.contiguous().numpy() for t in want.columns()])
        split_got = split_logprobs(queries, [t.numpy() for t in got.columns()])
        for a, b in zip(split_want, split_got, strict=True):
            for x, y in zip(a.columns(), b.columns(), strict=True):
                np.testing.assert_array_equal(x, y)
    assert all(key.source for key in graphs._graphs) and len(graphs._graphs) == 4


def test_greedy_rows_read_back_as_one_part_equal_each_view_read_back_alone():
    """`GreedyRows.views` say where the tokens and columns lie in their buffer: read back as that one
    part (`add_packed`, beside a part before and after it), each is what an `add` of its view gives."""
    from services.scheduler.host_io import HostReadback

    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=False)
    source = _logits(4, seed=30)
    queries = [LogprobQuery(np.asarray([i], np.int64), None, 5, (1, 2)) for i in range(4)]
    inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, False, 4).items()}
    found = graphs.greedy(queries, inputs, source, False)
    views = [found.tokens[:, None], *found.rows.columns()]
    alone = HostReadback()
    handles = [alone.add(view) for view in views]
    want = alone.fetch()
    readback = HostReadback()
    before = readback.add(torch.arange(3, dtype=torch.int32))
    packed = readback.add_packed(found.packed, found.views)
    after = readback.add(torch.full((2,), 7, dtype=torch.int64))
    host = readback.fetch()
    assert readback.num_copies == 1 and len(packed) == len(views) == 5
    assert host[packed[0]].ravel().tolist() == source.argmax(dim=-1).tolist()
    for got, handle in zip(packed, handles, strict=True):
        assert host[got].dtype == want[handle].dtype
        np.testing.assert_array_equal(host[got], want[handle])
    assert host[before].tolist() == [0, 1, 2] and host[after].tolist() == [7, 7]


@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize("k, num_ids", [(1, 0), (5, 2), (20, 0), (20, 4)])
def test_greedy_buffers_align_every_column_to_16_bytes_and_still_read_back_in_one_copy(rows, k, num_ids):
    """Triton compiles its kernels again for a pointer not 16-byte aligned: the greedy buffer's
    columns all start at 16 bytes (the warm-up's fresh tensors do), padding between them, and the
    readback still copies the buffer once, reading each column past the padding."""
    from services.scheduler.host_io import HostReadback
    from services.scheduler.logprob_graphs import _Key, _packed_buffer, _packed_tokens

    packed, rows_out, views = _packed_buffer(_Key(rows, k, num_ids, None), torch.device("cpu"))
    columns = [_packed_tokens(packed, rows), *rows_out.columns()]
    assert all((c.data_ptr() - packed.data_ptr()) % 16 == 0 for c in columns if c.numel())
    assert all(view.offset == (c.data_ptr() - packed.data_ptr()) // 4 for view, c in zip(views, columns, strict=True) if c.numel())
    assert [(view.dtype, view.shape) for view in views] == [(torch.int64, (rows, 1)), *((c.dtype, tuple(c.shape)) for c in columns[1:])]
    columns[0].copy_(torch.arange(rows) + 7)  # tokens (int64 that fit 32 bits, as token ids do)
    for i, column in enumerate(columns[1:], start=1):  # distinct words in every other column
        column.view(torch.int32).view(-1).copy_(torch.arange(column.numel(), dtype=torch.int32) + 100 * i)
    readback = HostReadback()
    handles = [readback.add(columns[0][:, None]), *(readback.add(c) for c in columns[1:])]
    host = readback.fetch()
    assert readback.num_copies == 1 and readback.num_joined == 0
    assert host[handles[0]].ravel().tolist() == columns[0].tolist()
    for handle, column in zip(handles[1:], columns[1:], strict=True):
        np.testing.assert_array_equal(host[handle], column.numpy())
    whole = HostReadback()  # the buffer as one part, read through its views
    packed_handles = whole.add_packed(packed, views)
    for got, want in zip(whole.fetch(), host, strict=True):
        np.testing.assert_array_equal(got, want)
    assert packed_handles == list(range(5))


def test_a_replayed_greedy_call_launches_nothing_without_requested_ids(fake_cuda_capture):
    """Top-k alone: no copy in (the logits are read in place, the targets are the graph's argmax), so
    the host's cost is the replay; requested ids add their one copy."""
    from ops.bench.logprob_ops import OpCounter

    graphs = LogprobGraphs(TopKKeys.build(VOCAB, "cpu"), capture=True)
    source = _logits(2, seed=31)
    for ids, copies in (((), 0), ((5, 6), 1)):
        queries = [LogprobQuery(np.asarray([i], np.int64), None, 20, ids) for i in range(2)]
        inputs = {name: torch.from_numpy(a) for name, a in logprob_inputs(queries, False, 2).items()}
        graphs.greedy(queries, inputs, source, False)  # captures
        with OpCounter() as counter:
            graphs.greedy(queries, inputs, source, False)
        assert counter.num_kernels == copies, counter.kernels
    assert graphs.num_captured == 2 and all(key.source == source.data_ptr() for key in graphs._graphs)


@pytest.mark.parametrize("mode", ["raw", "processed"])
def test_a_core_on_decode_graphs_takes_greedy_steps_with_logprobs_in_one_span_and_serves_what_it_did_before(
    make_core, tiny_runner, mode
):
    """Greedy requests that all ask for output logprobs (3 and 4 of them: a padded rung and an exact
    one), and a pair with a penalty (processed logits: the general path), through the decode graphs'
    twin: tokens and logprobs equal those of the same core with the greedy path switched off (`_verify`
    and `compute`), bit for bit, and every decode step the greedy path took was read back as one span."""
    top20 = LogprobParams(return_logprob=True, top_logprobs_num=20)
    with_ids = LogprobParams(return_logprob=True, top_logprobs_num=5, token_ids_logprob=(7, 3, 1999))
    groups = [
        [request(f"a{i}", prompt_of(700 + i, 5 + i), max_new_tokens=6, ignore_eos=True, logprobs=top20) for i in range(3)],
        [request(f"b{i}", prompt_of(710 + i, 4), max_new_tokens=5, ignore_eos=True, logprobs=(top20, with_ids)[i % 2]) for i in range(4)],
        [request(f"c{i}", prompt_of(720 + i, 6), max_new_tokens=4, ignore_eos=True, logprobs=top20,
                 **({"repetition_penalty": 1.3} if i == 0 else {})) for i in range(2)],  # fmt: skip
    ]
    tiny_runner.prepare_decode_graphs(ladder=(1, 2, 4), max_blocks_per_seq=8, capture=False)
    try:
        for reqs in groups:
            want = run(make_core(logprobs_mode=mode, logprob_graphs=True), reqs)  # the switch off: `_verify` and `compute`
            core = make_core(logprobs_mode=mode, logprob_graphs=True, greedy_logprob_graphs=True)
            graphs, readback = core.worker.logprob_graphs, core.worker._readback
            taken, original = [], graphs.greedy
            graphs.greedy = lambda *a: taken.append(readback.num_joined) or original(*a)
            _assert_exact(want, run(core, reqs))
            if reqs[0].rid.startswith("c"):
                assert not taken  # a penalty's processed logits: not the greedy path
            else:
                assert len(taken) >= 3 and readback.num_joined == taken[0]  # no greedy step needed a join
    finally:
        tiny_runner.drop_decode_graphs()
