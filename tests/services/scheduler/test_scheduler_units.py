"""Block manager, sampler, top-k ordering, config and TokenBatch encoding: no model needed."""

from __future__ import annotations

from collections.abc import Callable

import msgspec
import numpy as np
import pytest
import torch

from contracts.arrays import NDArray
from contracts.detokenizer import Finish, FinishType, TokenBatch
from contracts.logprobs import LogprobColumns
from contracts.scheduler import SamplingParams
from services.common.arrays import from_wire
from services.scheduler.block_manager import BlockManager
from services.scheduler.config import SchedulerConfig
from services.scheduler.flags import DEFAULT_MAX_PREFILL_TOKENS
from services.scheduler.logprobs import (
    LogprobQuery,
    TopKKeys,
    logprob_inputs,
    logprobs_on_device,
    split_logprobs,
    top_k_sorted,
)
from services.common.logprob_rows import RequestLogprobs, RowLogprobs, RowSpan, from_columns, to_columns
from services.scheduler.request import RequestOutput
from services.scheduler.sampler import Sampler, SampleRow
from services.scheduler.wire import to_token_batches

# ---- block manager ----


def compute_logprobs(
    queries: list[LogprobQuery],
    source: torch.Tensor,
    to_logits: Callable[[torch.Tensor], torch.Tensor] | None,
    vocab_size: int,
    processed: bool,
) -> list[RowLogprobs]:
    """The worker's two halves of the logprob path in one call, for tests. `source` is hidden states [N, H] (then `to_logits` maps rows to f32 logits) or f32 logits [N, V]."""
    inputs = {name: torch.from_numpy(a).to(source.device) for name, a in logprob_inputs(queries, processed).items()}
    keys = TopKKeys.build(vocab_size, source.device)
    on_device = logprobs_on_device(queries, inputs, source, to_logits, keys, processed)
    host = [t.cpu().numpy() for t in on_device.columns()] if on_device is not None else None
    return split_logprobs(queries, host)


def test_block_manager_tables_grow_past_their_first_room_and_slots_read_them():
    """A table grows one block at a time past its array's first room (8 ids) and by many at once;
    its view, the short and the long slot paths all read the same ids; shrink and free give them back."""
    blocks = BlockManager(num_blocks=200, block_size=4)
    for tokens in range(1, 41):  # 10 blocks, one token at a time
        blocks.allocate("a", tokens)
    blocks.allocate("b", 4 * 30)  # 30 blocks at once
    blocks.allocate("a", 4 * 50)  # 40 more
    table = blocks.block_table("a")
    assert table.dtype == np.int32 and table.tolist() == [*range(10), *range(40, 80)]
    expected = [table[p // 4] * 4 + p % 4 for p in range(190)]
    assert blocks.slots("a", 37, 45) == expected[37:45]  # short: a list
    np.testing.assert_array_equal(blocks.slots("a", 3, 190), expected[3:190])  # long: int64 [187]
    blocks.shrink("a", 41)  # 11 blocks kept
    assert blocks.block_table("a").tolist() == [*range(10), 40] and blocks.num_free_blocks == 200 - 30 - 11
    blocks.free("a"), blocks.free("b")
    assert blocks.num_free_blocks == 200 and blocks.block_table("a").size == 0


def test_block_manager_allocates_appends_and_rolls_back():
    blocks = BlockManager(num_blocks=4, block_size=4)
    blocks.allocate("a", 5)  # 2 blocks
    assert blocks.num_free_blocks == 2 and blocks.capacity("a") == 8
    np.testing.assert_array_equal(blocks.slots("a", 3, 6), [3, 4, 5])
    assert blocks.can_allocate("a", 16) and not blocks.can_allocate("a", 17)
    blocks.allocate("a", 13)  # a verify block of several tokens at once
    assert blocks.num_free_blocks == 0
    blocks.shrink("a", 6)  # rejected tokens rolled back: whole trailing blocks come back
    assert blocks.num_free_blocks == 2 and blocks.capacity("a") == 8
    with pytest.raises(MemoryError):
        blocks.allocate("b", 9)
    blocks.free("a")
    assert blocks.num_free_blocks == 4 and not blocks.holds("a")


# ---- sampler ----


def _rows(n, **params):
    return [SampleRow(SamplingParams(**params), position) for position in range(n)]


def test_greedy_picks_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0]])
    assert Sampler(0).sample(logits, _rows(1, temperature=0.0)).tolist() == [1]


@pytest.mark.parametrize("params", [dict(top_k=1), dict(top_p=1e-6), dict(min_p=1.0)])
def test_filters_that_keep_one_token_equal_greedy(params):
    logits = torch.randn(8, 50, generator=torch.Generator().manual_seed(0))
    sampled = Sampler(0).sample(logits, _rows(8, temperature=1.0, seed=7, **params))
    assert sampled.tolist() == logits.argmax(dim=-1).tolist()


def test_seeded_draw_depends_only_on_seed_and_position():
    logits = torch.zeros(1, 1000)  # uniform: the draw is all noise
    row = [SampleRow(SamplingParams(temperature=1.0, seed=5), 3)]
    first = Sampler(0).sample(logits, row).item()
    crowded = torch.zeros(4, 1000)
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=s), p) for s, p in ((1, 0), (5, 3), (9, 9), (5, 4))]
    assert Sampler(123).sample(crowded, rows)[1].item() == first
    draws = {Sampler(0).sample(logits, [SampleRow(SamplingParams(temperature=1.0, seed=5), p)]).item() for p in range(20)}
    assert len(draws) > 10  # positions get different draws


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.7, 0.2, 0.1, 0.0])
    logits = probs.log().expand(4000, 4).contiguous()
    rows = [SampleRow(SamplingParams(temperature=1.0, seed=i), 0) for i in range(4000)]
    counts = np.bincount(Sampler(0).sample(logits, rows).numpy(), minlength=4) / 4000
    np.testing.assert_allclose(counts, probs.numpy(), atol=0.03)


# ---- logprobs ----


def test_top_k_sorted_breaks_ties_by_smaller_id():
    logprobs = torch.tensor([[-1.0, -0.5, -1.0, -0.5, -3.0, -1.0]])
    values, ids = top_k_sorted(logprobs, 4, TopKKeys.build(6, "cpu"))
    assert ids.tolist() == [[1, 3, 0, 2]]
    assert values.tolist() == [[-0.5, -0.5, -1.0, -1.0]]


@pytest.mark.parametrize("k", [1, 3, 20, 64])
def test_top_k_sorted_equals_a_full_stable_sort_under_heavy_ties(k):
    """Few distinct values (bf16 logits upcast tie this often): the set and order of a full sort by
    (value descending, id ascending), for ties inside the top k and across its boundary."""
    logprobs = torch.randint(-6, 0, (50, 64), generator=torch.Generator().manual_seed(k)).float() / 4  # [n, V]
    logprobs[0] = -1.0  # one row all tied
    values, ids = top_k_sorted(logprobs, k, TopKKeys.build(64, "cpu"))
    rows = logprobs.numpy()
    want = np.stack([np.lexsort((np.arange(64), -row))[:k] for row in rows])  # [n, k]
    np.testing.assert_array_equal(ids.numpy(), want)
    np.testing.assert_array_equal(values.numpy(), np.take_along_axis(rows, want, 1))
    assert ids.dtype == torch.int32


def test_compute_logprobs_chunks_rows_and_slices_per_request(monkeypatch):
    monkeypatch.setattr("services.scheduler.logprobs.MAX_CHUNK_ROWS", 2)
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(1))
    queries = [
        LogprobQuery(np.array([0, 2, 4]), np.array([1, 2, 3]), top_k=3, token_ids=(5,)),
        LogprobQuery(np.array([1]), np.array([9]), top_k=0, token_ids=()),
    ]
    first, second = compute_logprobs(queries, logits, None, 30, processed=False)
    expected = torch.log_softmax(logits, dim=-1)
    np.testing.assert_allclose(first.token, expected[[0, 2, 4], [1, 2, 3]].numpy(), atol=1e-6)
    np.testing.assert_allclose(first.top_values, expected[[0, 2, 4]].topk(3).values.numpy(), atol=1e-6)
    np.testing.assert_allclose(first.ids[:, 0], expected[[0, 2, 4], 5].numpy(), atol=1e-6)
    assert second.top_values.shape == (1, 0) and second.ids.shape == (1, 0)



def test_split_logprobs_views_full_width_rows_and_cuts_narrower_queries():
    """Each query takes its own rows of the step's columns: a span of them (read as views) when it
    asks for the widest k and ids (every request alike, the usual decode step), cut to its k and
    ids (contiguous) otherwise."""
    token = np.arange(4, dtype=np.float32)  # [n]
    top_values = np.arange(12, dtype=np.float32).reshape(4, 3)  # [n, max_k]
    top_ids = np.arange(12, dtype=np.int32).reshape(4, 3)
    ids = np.arange(8, dtype=np.float32).reshape(4, 2)  # [n, max_m]
    queries = [
        LogprobQuery(np.array([0]), None, top_k=3, token_ids=(4, 5)),
        LogprobQuery(np.array([1, 2]), None, top_k=1, token_ids=(4,)),
        LogprobQuery(np.array([3]), None, top_k=0, token_ids=()),
    ]
    wide, narrow, bare = split_logprobs(queries, [token, top_values, top_ids, ids])
    assert isinstance(wide, RowSpan) and (wide.first, wide.count) == (0, 1)
    assert all(np.shares_memory(a, b) for a, b in zip(wide.columns(), (token, top_values, top_ids, ids)))
    assert isinstance(narrow, RowLogprobs) and isinstance(bare, RowLogprobs)
    np.testing.assert_array_equal(wide.top_ids, [[0, 1, 2]])
    np.testing.assert_array_equal(narrow.token, [1, 2])
    np.testing.assert_array_equal(narrow.top_values, [[3], [6]])
    np.testing.assert_array_equal(narrow.ids, [[2], [4]])
    assert narrow.top_values.flags.c_contiguous and narrow.ids.flags.c_contiguous
    assert bare.top_values.shape == (1, 0) and bare.top_ids.shape == (1, 0) and bare.ids.shape == (1, 0)


def test_prompt_rows_chunk_by_the_prompt_budget_and_verify_rows_by_the_larger_one(monkeypatch):
    """Rows the chunk computes logits for (prompt rows, through the LM head) chunk by
    PROMPT_CHUNK_BYTES, rows of given logits by CHUNK_BYTES; the results do not depend on it."""
    vocab = 30
    monkeypatch.setattr("services.scheduler.logprobs.PROMPT_CHUNK_BYTES", 2 * 4 * vocab)  # 2 rows a chunk
    monkeypatch.setattr("services.scheduler.logprobs.CHUNK_BYTES", 4 * 4 * vocab)  # 4 rows a chunk
    hidden = torch.randn(7, vocab, generator=torch.Generator().manual_seed(2))
    queries = [LogprobQuery(np.arange(7), np.arange(7), top_k=2, token_ids=())]
    sizes = []

    def to_logits(rows):
        sizes.append(rows.shape[0])
        return rows.float()

    (through_head,) = compute_logprobs(queries, hidden, to_logits, vocab, processed=False)
    assert sizes == [2, 2, 2, 1]
    (given,) = compute_logprobs(queries, hidden, None, vocab, processed=False)
    np.testing.assert_array_equal(through_head.top_values, given.top_values)
    np.testing.assert_array_equal(through_head.token, given.token)


# ---- config ----


def test_config_validates_its_choices():
    with pytest.raises(ValueError, match="device"):
        SchedulerConfig(device="tpu")
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=0)
    with pytest.raises(ValueError, match="verify_mode"):
        SchedulerConfig(verify_mode="loose")
    with pytest.raises(ValueError, match="num_draft_tokens"):
        SchedulerConfig(num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_context_window must be >= 0"):
        SchedulerConfig(draft_context_window=-1)
    assert SchedulerConfig(draft_context_window=0).draft_context_window == 0  # 0: the whole context
    assert SchedulerConfig(speculative_algorithm="dspark", draft_model="/some/draft").resolved_draft_model == "/some/draft"
    config = SchedulerConfig(device="cpu")
    assert config.torch_dtype == torch.float32 and config.resolved_device == "cpu"
    with pytest.raises(ValueError, match="max_prefill_tokens .* at least chunked_prefill_size"):
        SchedulerConfig(chunked_prefill_size=4096, max_prefill_tokens=2048)
    assert config.resolved_max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS > config.chunked_prefill_size
    assert SchedulerConfig(chunked_prefill_size=65536).resolved_max_prefill_tokens == 65536  # never below the chunk budget
    assert SchedulerConfig(max_prefill_tokens=4096).resolved_max_prefill_tokens == 4096


# ---- wire ----


class _NoFlatTokenBatch(msgspec.Struct, frozen=True, gc=False, omit_defaults=True):
    """TokenBatch without its flat prompt arrays (PRODUCT §5: a batch with no opted-in request
    encodes as if the field did not exist)."""

    scheduler_id: str
    step: int
    rids: list[str]
    num_new_tokens: NDArray
    new_token_ids: NDArray
    prompt_tokens: NDArray
    finish: list[Finish | None]
    spec_verify_ct: NDArray | None = None
    output_logprobs: LogprobColumns | None = None
    prompt_logprobs: LogprobColumns | None = None


def _outputs():
    prompt = RowLogprobs.of(np.array([np.nan, -1.0], np.float32), np.array([[np.nan], [-1.0]], np.float32),
                            np.array([[-1], [4]], np.int32), start=0)  # fmt: skip
    entries = RequestLogprobs(output=RowLogprobs.of(np.array([-0.5], np.float32)), prompt=prompt)
    return [
        RequestOutput("a", "d1", [4], 2, None, entries),
        RequestOutput("b", "d1", [], 3, Finish(FinishType.ABORT, message="gone"), None),
        RequestOutput("c", "d2", [1, 2], 1, Finish(FinishType.LENGTH), None),
    ]


def test_each_kind_of_rows_alone_is_news_and_none_is_not():
    assert RequestLogprobs().is_empty()
    rows = RowLogprobs.of(np.zeros(1, np.float32))
    for kind in ("output", "prompt", "flat"):
        assert not RequestLogprobs(**{kind: rows}).is_empty(), kind


def test_token_batches_are_grouped_per_detokenizer_and_columnar():
    batches = to_token_batches(_outputs(), "s", 7)
    assert set(batches) == {"d1", "d2"}
    d1 = msgspec.msgpack.decode(msgspec.msgpack.encode(batches["d1"]), type=TokenBatch)
    assert d1.rids == ["a", "b"] and d1.step == 7
    assert bytes(d1.num_new_tokens.data) == np.array([1, 0], "<i4").tobytes()
    prompt = from_columns(d1.prompt_logprobs, 2)
    assert prompt[1] is None and prompt[0].start == 0 and prompt[0].top_ids.tolist() == [[-1], [4]]
    assert [None if r is None else r.token.tolist() for r in from_columns(d1.output_logprobs, 2)] == [[-0.5], None]
    assert d1.prompt_top_flat is None
    d2 = batches["d2"]  # nobody there asked
    assert d2.output_logprobs is None and d2.prompt_logprobs is None and d2.prompt_top_flat is None


def test_output_entries_of_several_requests_travel_as_the_batch_columns():
    outputs = _outputs()
    top = RequestLogprobs(output=RowLogprobs.of(np.array([-0.25, -2.0], np.float32), np.array([[-0.25], [-0.5]], np.float32),
                                                np.array([[1], [6]], np.int32)))  # fmt: skip
    outputs[2] = RequestOutput("c", "d1", [1, 2], 1, Finish(FinishType.LENGTH), top)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(to_token_batches(outputs, "s", 7)["d1"]), type=TokenBatch)
    columns = batch.output_logprobs
    assert batch.rids == ["a", "b", "c"] and from_wire(columns.rows).tolist() == [1, 0, 2]
    assert from_wire(columns.token).tolist() == [-0.5, -0.25, -2.0] and from_wire(columns.top_k).tolist() == [0, 0, 1]
    assert from_wire(columns.top_ids).tolist() == [1, 6]
    # the prompt's rows are a's alone
    assert from_wire(batch.prompt_logprobs.rows).tolist() == [2, 0, 0]
    # without prompt rows in the batch, no prompt columns at all
    outputs[0] = RequestOutput("a", "d1", [4], 2, None, RequestLogprobs(output=RowLogprobs.of(np.array([-0.5], np.float32))))
    outputs[1] = RequestOutput("b", "d1", [], 3, None, RequestLogprobs())  # asked; a prefill chunk, nothing new
    batch = to_token_batches(outputs, "s", 8)["d1"]
    assert batch.prompt_logprobs is None and from_wire(batch.output_logprobs.rows).tolist() == [1, 0, 2]
    outputs = [RequestOutput(o.rid, o.detokenizer_id, o.new_token_ids, o.prompt_tokens, o.finish, None) for o in outputs]
    assert to_token_batches(outputs, "s", 9)["d1"].output_logprobs is None


def test_batch_without_flat_requests_encodes_as_if_the_fields_did_not_exist():
    batch = to_token_batches(_outputs(), "s", 7)["d1"]
    old = _NoFlatTokenBatch(**{f: getattr(batch, f) for f in _NoFlatTokenBatch.__struct_fields__})
    assert batch.prompt_top_flat is None and msgspec.msgpack.encode(batch) == msgspec.msgpack.encode(old)


def test_rows_of_every_width_and_start_come_back_from_the_columns_as_they_went():
    """`to_columns` then `from_columns` (the one encoder and decoder): each request's rows equal, its
    widths and start kept, requests without rows None; the flat arrays (no token) too."""
    rng = np.random.default_rng(0)

    def rows(n, k, m, start=0, token=True):
        return RowLogprobs.of(rng.random(n, np.float32) if token else None, rng.random((n, k), np.float32),
                              rng.integers(0, 99, (n, k)).astype(np.int32), rng.random((n, m), np.float32), start)  # fmt: skip

    for batch in ([rows(2, 3, 1, 5), None, rows(1, 0, 2, 7), rows(3, 3, 0)], [rows(4, 2, 0, 1, token=False), None]):
        wire = msgspec.msgpack.decode(msgspec.msgpack.encode(to_columns(batch)), type=LogprobColumns)
        for sent, got in zip(batch, from_columns(wire, len(batch)), strict=True):
            assert (sent is None) == (got is None)
            if sent is not None:
                assert got.start == sent.start and (got.token is None) == (sent.token is None)
                for kind in ("token", "top_values", "top_ids", "ids"):
                    if getattr(sent, kind) is not None:
                        np.testing.assert_array_equal(getattr(got, kind), getattr(sent, kind), err_msg=kind)


def test_processed_mode_is_the_filtered_sampling_distribution():
    from contracts.scheduler import SamplingParams
    from services.scheduler.logprobs import FILTERED_LOGPROB

    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    sampling = SamplingParams(temperature=0.5, top_k=3)
    query = LogprobQuery(np.array([0, 1, 2]), np.array([0, 1, 2]), top_k=5, token_ids=(), sampling=sampling)
    (result,) = compute_logprobs([query], logits, None, 40, processed=True)
    scaled = logits / 0.5
    kept = scaled.topk(3).indices  # [3, 3]
    expected = torch.full_like(scaled, float("-inf")).scatter(1, kept, scaled.gather(1, kept)).log_softmax(-1)
    np.testing.assert_allclose(result.top_values[:, :3], expected.topk(3).values.numpy(), atol=1e-5)
    assert (result.top_values[:, 3:] == FILTERED_LOGPROB).all()  # beyond top_k: filtered, at the floor
    assert np.allclose(np.exp(result.top_values[:, :3]).sum(axis=1), 1.0, atol=1e-5)  # renormalised
    (raw,) = compute_logprobs([query], logits, None, 40, processed=False)
    np.testing.assert_allclose(raw.top_values, logits.log_softmax(-1).topk(5).values.numpy(), atol=1e-5)


def test_processed_top_p_keeps_the_token_that_crosses_the_mass():
    from contracts.scheduler import SamplingParams

    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    query = LogprobQuery(np.array([0]), np.array([2]), top_k=4, token_ids=(), sampling=SamplingParams(top_p=0.6))
    (result,) = compute_logprobs([query], logits, None, 4, processed=True)
    np.testing.assert_allclose(np.exp(result.top_values[0, :2]), [0.5 / 0.8, 0.3 / 0.8], atol=1e-6)
    assert result.token[0] < -1000  # token 2 is outside the top-p set


def test_processed_mode_floors_logprobs_even_when_sampling_changes_nothing():
    logits = torch.tensor([[0.0, -20000.0, -1.0]])
    query = LogprobQuery(np.array([0]), np.array([1]), top_k=3, token_ids=(1,))  # temperature 1, no filters
    (processed,) = compute_logprobs([query], logits, None, 3, processed=True)
    (raw,) = compute_logprobs([query], logits, None, 3, processed=False)
    assert processed.token[0] == processed.ids[0, 0] == processed.top_values[0, -1] == -9999.0
    assert raw.token[0] < -19000


def test_build_core_takes_the_prefill_budget_and_leaves_the_dense_path_to_cuda():
    from services.scheduler.build import build_core

    core = build_core(SchedulerConfig(device="cpu", chunked_prefill_size=512, max_prefill_tokens=4096))
    assert (core.policy.config.chunk_budget, core.policy.config.prefill_budget) == (512, 4096)
    assert core.worker.runner.dense_prefill is None  # `--dense-prefill` does nothing off CUDA
    assert build_core(SchedulerConfig(device="cpu")).policy.config.prefill_budget == DEFAULT_MAX_PREFILL_TOKENS


class _RunnerStandIn:
    """What `dense_prefill_config` reads of a runner: the device, dtype and head shape."""

    device = torch.device("cpu")
    dtype = torch.float32
    config = type("Heads", (), {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16})()


def test_dense_prefill_takes_flash4_where_it_compiles_and_sdpa_where_auto_meets_a_broken_install(monkeypatch):
    """FlashAttention-4 is chosen and compiled at start-up where it resolves; with auto, one that
    fails to compile leaves SDPA with a warning; asked for by name, its failure stops the start."""
    from services.scheduler import build

    warmed = []
    monkeypatch.setattr(build, "resolve_dense_kernel", lambda choice, device: "sdpa" if choice == "sdpa" else "flash4")
    monkeypatch.setattr(build, "warm_flash4", lambda *args: warmed.append(args))
    config = SchedulerConfig(device="cpu", chunked_prefill_size=512, max_prefill_tokens=4096)
    dense = build.dense_prefill_config(config, _RunnerStandIn())
    assert (dense.kernel, dense.min_query_len, warmed) == ("flash4", 513, [(torch.device("cpu"), torch.float32, 4, 2, 16)])
    assert build.dense_prefill_config(SchedulerConfig(device="cpu", dense_attention="sdpa"), _RunnerStandIn()).kernel == "sdpa"

    def broken(*args):
        raise RuntimeError("no CUDA driver for cutlass")

    monkeypatch.setattr(build, "warm_flash4", broken)
    assert build.dense_prefill_config(config, _RunnerStandIn()).kernel == "sdpa"
    with pytest.raises(RuntimeError, match="no CUDA driver"):
        build.dense_prefill_config(SchedulerConfig(device="cpu", dense_attention="flash4"), _RunnerStandIn())


def test_the_scheduler_config_refuses_an_unknown_dense_kernel():
    with pytest.raises(ValueError, match="dense_attention"):
        SchedulerConfig(dense_attention="cudnn")


def test_the_running_limit_defaults_from_the_kv_cache_on_cuda_only():
    import types

    from services.scheduler.build import default_max_running
    from services.scheduler.model.graphs import decode_ladder

    def runner(device: str, num_blocks: int):
        return types.SimpleNamespace(device=torch.device(device), num_blocks=num_blocks, block_size=16)

    assert default_max_running(runner("cpu", 10**6)) == 64
    assert default_max_running(runner("cuda", 100)) == 64  # a small cache: never below the old default
    assert default_max_running(runner("cuda", 20_480)) == 320  # 320k tokens: one request per 1024, in steps of 64
    assert default_max_running(runner("cuda", 10**6)) == 512
    assert default_max_running(runner("cuda", 10**6), "dspark") == 64
    assert decode_ladder(320)[-2:] == (256, 320) and decode_ladder(300)[-2:] == (256, 300)
    assert decode_ladder(64)[-1] == 64 and max(decode_ladder(512)) == 512 and 100 in decode_ladder(100)


def test_the_kv_fraction_defaults_lower_with_a_drafter_and_an_explicit_one_wins():
    from services.scheduler.flags import CUDA_KV_CACHE_FRACTION, DRAFTER_KV_CACHE_FRACTION

    assert DRAFTER_KV_CACHE_FRACTION < CUDA_KV_CACHE_FRACTION
    assert SchedulerConfig().resolved_kv_cache_memory_fraction == CUDA_KV_CACHE_FRACTION
    assert SchedulerConfig(speculative_algorithm="dspark").resolved_kv_cache_memory_fraction == DRAFTER_KV_CACHE_FRACTION
    assert SchedulerConfig(speculative_algorithm="dspark", kv_cache_memory_fraction=0.9).resolved_kv_cache_memory_fraction == 0.9
    with pytest.raises(ValueError, match=r"kv_cache_memory_fraction must be in \(0, 1\]"):
        SchedulerConfig(kv_cache_memory_fraction=0.0)


def test_out_of_memory_while_preparing_is_a_start_up_error_naming_the_flag(monkeypatch):
    from services.scheduler import build

    def short_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 96.00 MiB.\nmore detail")

    monkeypatch.setattr(build, "_prepare_runtime", short_of_memory)
    config = SchedulerConfig(speculative_algorithm="dspark")
    with pytest.raises(ValueError, match=r"capturing graphs with the KV cache at 0\.6 .* lower --kv-cache-memory-fraction .*"
                                         r"\(CUDA out of memory\. Tried to allocate 96\.00 MiB\.\)$"):  # fmt: skip
        build.prepare_runtime(config, None, None, None)
