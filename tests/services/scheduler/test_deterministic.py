"""`--deterministic` on the tiny CPU model: every id and logprob a request gets back is bitwise the
same (`torch.equal` on the raw float32 values) alone, in batches mixed with other requests'
prefill chunks, with its prompt chunked, after a preemption, under DSpark (static and compact) and
as one of `n` forks; seeded T=1 requests across batch compositions, DSpark on and off each.

The runner is batch-invariant by construction (`batch_invariant.py`: one product per row, one
attention call per token), so these hold whatever the BLAS does with the shape of a batch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from contracts.scheduler import ForkedChoice, LogprobParams
from services.models import RANDOM_TINY_MODEL
from services.scheduler.build import core_for
from services.scheduler.model import load_model_runner
from services.scheduler.model.batch_invariant import set_batch_invariant
from services.scheduler.spec.dspark import DSparkProposer
from services.scheduler.spec.dspark_config import draft_config_for_target
from services.scheduler.spec.dspark_loader import empty_drafter, fill_random_weights
from test_scheduler_core import prompt_of, request, run

FULL = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=20, token_ids_logprob=(7, 3, 1999),
                     flat_prompt_top_logprobs=True)  # fmt: skip
KINDS = (
    FULL,
    LogprobParams(return_logprob=True, top_logprobs_num=20, token_ids_logprob=(11,)),
    None,
    LogprobParams(return_logprob=True, logprob_start_len=2, top_logprobs_num=5),
)
REQUESTS = [
    request(f"r{i}", prompt_of(900 + i, 3 + 7 * i % 45), max_new_tokens=3 + i % 4, ignore_eos=True, logprobs=KINDS[i % 4])
    for i in range(64)
]
SOME = REQUESTS[::4] + REQUESTS[1::8]  # 24 requests, every kind
ARRAYS = ("input_token", "input_top_values", "input_top_ids", "input_ids",
          "output_token", "output_top_values", "output_top_ids", "output_ids")  # fmt: skip
MASK_TOKEN = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The row-wise twin makes many small calls: on a shared 2-core box a second OpenMP thread only waits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def runner(one_thread):
    return load_model_runner(RANDOM_TINY_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=256, kv_block_size=16,
                             batch_invariant=True)  # fmt: skip


@pytest.fixture(scope="module")
def dspark(runner):
    def make() -> DSparkProposer:
        config = draft_config_for_target(runner.config, num_draft_layers=1, mask_token_id=MASK_TOKEN, block_size=4,
                                         markov_rank=8, enable_confidence_head=True)  # fmt: skip
        drafter = empty_drafter(config, runner.model.model.embed_tokens, runner.lm_head_weight)
        fill_random_weights(drafter, seed=3)
        set_batch_invariant(drafter, True)
        return DSparkProposer(drafter.eval(), runner.num_blocks, runner.block_size)

    return make


def core(runner, **options):
    return core_for(runner, **{"max_running_requests": 64, "chunked_prefill_size": 256, "seed": 0, **options})


@pytest.fixture(scope="module")
def alone(runner):
    """Each request in a step of its own: one unchunked prefill, then decodes of one row."""
    return {r.rid: run(core(runner), [r])[r.rid] for r in REQUESTS}


def bits(values: np.ndarray) -> torch.Tensor:
    """The raw bits of float32 values (NaN rows, the prompt's first, compare equal to themselves)."""
    return torch.from_numpy(values.view(np.int32) if values.dtype == np.float32 else values)


def assert_bitwise(expected: dict, got: dict, rids=None) -> None:
    for rid in rids or got:
        a, b = expected[rid], got[rid]
        assert b.tokens == a.tokens and b.finish == a.finish, rid
        for name in ARRAYS:
            assert bool(getattr(a, name)) == bool(getattr(b, name)), (rid, name)
            if getattr(a, name):
                assert torch.equal(bits(a.cat(name)), bits(b.cat(name))), (rid, name)
        assert (a.flat is None) == (b.flat is None), rid
        if a.flat is not None:
            assert all(torch.equal(bits(x), bits(y)) for x, y in zip(a.flat[:2], b.flat[:2])), rid
            assert a.flat[2] == b.flat[2]


def test_all_at_once_and_joining_beside_prefill_chunks_is_bitwise_alone(runner, alone):
    joins = {2: REQUESTS[40:52], 5: REQUESTS[52:]}  # arrivals' prefill chunks beside running decodes
    got = run(core(runner, chunked_prefill_size=64), REQUESTS[:40], joins)
    assert set(got) == set(alone)
    assert_bitwise(alone, got)


@pytest.mark.parametrize("chunk", [5, 13, 32])
def test_chunked_prompts_are_bitwise_one_prefill(runner, alone, chunk):
    c = core(runner, chunked_prefill_size=chunk)
    got = run(c, SOME)
    assert c.stats().num_prompt_tokens == sum(len(r.prompt_ids) for r in SOME)
    assert_bitwise(alone, got)


def test_preempted_and_recomputed_requests_are_bitwise_alone(runner):
    growing = [request(r.rid, r.prompt_ids.tolist(), max_new_tokens=20, ignore_eos=True, logprobs=r.logprobs) for r in SOME[:8]]
    lone = {r.rid: run(core(runner), [r])[r.rid] for r in growing}
    c = core(runner, num_blocks=6, chunked_prefill_size=64)  # 96 slots for 8 requests growing to 23..66 tokens
    got = run(c, growing)
    assert c.num_preemptions > 0
    assert_bitwise(lone, got)


@pytest.mark.parametrize("verify_mode", ["static", "compact"])
def test_dspark_greedy_is_bitwise_plain_alone(runner, alone, dspark, verify_mode):
    c = core(runner, chunked_prefill_size=48, proposer=dspark(), verify_mode=verify_mode)
    got = run(c, SOME[:12], {3: SOME[12:]})
    assert c.stats().num_drafted_tokens > 0
    assert_bitwise(alone, got)


def test_forks_are_bitwise_alone(runner, alone):
    base = REQUESTS[4]  # full logprobs, flat arrays included
    forked = dataclasses.replace(base, choices=tuple(ForkedChoice(f"{base.rid}.{j}", "detok", 17 + j) for j in (1, 2, 3)))
    got = run(core(runner, chunked_prefill_size=16), [forked, *SOME[2:7]])
    for j in (1, 2, 3):
        assert_bitwise({f"{base.rid}.{j}": alone[base.rid]}, got, [f"{base.rid}.{j}"])
    assert_bitwise(alone, got, [base.rid, *(r.rid for r in SOME[2:7])])


SEEDED = [request(f"s{i}", prompt_of(60 + i, 5 + 3 * i), temperature=1.0, seed=100 + i, max_new_tokens=8, ignore_eos=True,
                  logprobs=KINDS[i % 2]) for i in range(6)]  # fmt: skip


@pytest.mark.parametrize("with_dspark", [False, True])
def test_seeded_sampling_is_bitwise_across_batch_compositions(runner, dspark, with_dspark):
    spec = (lambda: {"proposer": dspark()}) if with_dspark else dict
    lone = {r.rid: run(core(runner, **spec()), [r])[r.rid] for r in SEEDED}
    others = [request(f"o{r.rid}", r.prompt_ids.tolist(), temperature=0.7, max_new_tokens=6, logprobs=r.logprobs)
              for r in SOME[:8]]  # fmt: skip
    busy = run(core(runner, chunked_prefill_size=12, **spec()), [*others[:4], *SEEDED[:3]], {2: [*others[4:], *SEEDED[3:]]})
    assert_bitwise(lone, busy, [r.rid for r in SEEDED])
    assert len({tuple(r.tokens) for r in lone.values()}) == len(SEEDED)


@pytest.mark.parametrize("context_window", [None, 40])
def test_a_blocks_drafts_are_bitwise_alone_and_beside_longer_contexts(runner, dspark, context_window):
    """The drafter's block attention (`dspark_model.attend_block_rows`): one request's drafts, their
    q and confidences are the same bits proposed alone and beside rows whose longer contexts widen
    every row's context keys (SDPA over the batch's widest context rounds them otherwise)."""
    from services.scheduler.spec.base import ContextRows, DraftRequest

    proposer = dspark()
    proposer.context_window = context_window
    lens, width = [7, 230, 45, 130], 16  # context lengths; table blocks per sequence
    tables = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    hidden = torch.randn(sum(lens), proposer.drafter.fc.in_features, generator=torch.Generator().manual_seed(0))
    for b, (n, rows) in enumerate(zip(lens, hidden.split(lens))):
        positions = torch.arange(n)
        proposer.inject(ContextRows(rows, positions, tables[b].long()[positions // 16] * 16 + positions % 16))

    def propose(rows: list[int], temperature: float):
        return proposer.propose(DraftRequest(tuple(map(str, rows)), torch.tensor([11 + r for r in rows]),
                                             torch.tensor([lens[r] for r in rows]), tables[rows], max(lens[r] for r in rows),
                                             (temperature,) * len(rows), tuple(100 + r for r in rows)))  # fmt: skip

    for temperature in (0.0, 1.0):
        for row in (0, 2):
            alone, batched = propose([row], temperature), propose([0, 1, 2, 3], temperature)
            for name in ("tokens", "probs", "confidence"):
                a, b = getattr(alone, name), getattr(batched, name)
                assert (a is None) == (b is None) and (a is None or torch.equal(a[0], b[row])), (row, temperature, name)


@pytest.mark.parametrize("deterministic", [False, True])
def test_build_resolves_the_mode_once_into_the_runner_and_the_drafter(deterministic, tmp_path):
    from ops.bench.scheduler_harness import proposer_of, runner_of, tiny_draft_config
    from services.scheduler.build import build_core
    from services.scheduler.config import SchedulerConfig

    draft = tiny_draft_config(RANDOM_TINY_MODEL, tmp_path)
    built = build_core(SchedulerConfig(model=str(RANDOM_TINY_MODEL), device="cpu", num_kv_blocks=32, load_format="dummy",
                                       deterministic=deterministic, speculative_algorithm="dspark", draft_model=str(draft)))  # fmt: skip
    runner, drafter = runner_of(built), proposer_of(built).drafter
    assert runner.batch_invariant == deterministic and runner.model.batch_invariant == deterministic
    for model in (runner.model, drafter):
        flags = [m.invariant for m in model.modules() if hasattr(m, "invariant")]
        assert flags and all(flag == deterministic for flag in flags)
    assert runner.decode_graphs is None


def test_on_cuda_the_mode_takes_the_fused_logprobs_split_by_the_vocabulary_alone(monkeypatch):
    """torch's CUDA log_softmax was not batch-invariant at a 151,936-token vocabulary (an H100 run of
    `sparkwire bench deterministic`: one ulp between a row alone and in a batch); the mode keeps the
    fused kernels and the worker hands them its runner's invariance (their splits from the vocabulary alone)."""
    from types import SimpleNamespace

    from services.scheduler import build
    from services.scheduler.config import SchedulerConfig
    from services.scheduler.worker.worker import ModelWorker, WorkerOptions

    monkeypatch.setattr(build, "triton_available", lambda: True)
    cuda = SimpleNamespace(device=torch.device("cuda"), num_blocks=64, block_size=16)  # a KV size: the running limit from memory
    assert build.resolve(SchedulerConfig(device="cpu", deterministic=True), cuda).worker.fused_logprobs
    for invariant in (False, True):
        runner = SimpleNamespace(device=torch.device("cpu"), config=SimpleNamespace(vocab_size=96, eos_token_ids=(0,)), batch_invariant=invariant,
                                 sharded_rows=None)
        worker = ModelWorker(runner, WorkerOptions(logprob_graphs=True, fused_logprobs=True))
        assert worker.logprob_graphs.invariant is invariant and worker._invariant_logprobs is invariant
