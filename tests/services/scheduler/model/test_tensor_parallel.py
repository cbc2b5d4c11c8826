"""Tensor parallelism on the CPU with real rank processes over gloo: TP = 2 and 4 serve exactly what
TP = 1 serves (ids identical, every logprob kind within 1e-5 in fp32; dense and MoE families;
sampled rows drawn from vocabulary shards), DSpark with its drafter sharded too drafts TP = 1's
greedy blocks on 2 and 4 ranks and is lossless at T = 1, and a dead rank fails the step with a
clear error instead of hanging. One rank group per (model, size) for the whole module."""

from __future__ import annotations

import dataclasses
import os
import signal

import numpy as np
import pytest
import torch

from contracts.scheduler import ForkedChoice, LogprobParams
from services.scheduler.build import check_model, core_for, load_leader
from services.scheduler.config import SchedulerConfig
from services.scheduler.model import load_model_runner
from services.scheduler.model.config import ModelConfig
from services.scheduler.model.fp8 import Fp8Linear, Fp8Scheme
from services.scheduler.model.tensor_parallel import TensorParallel, TensorParallelError, check_shardable
from services.scheduler.rank_group import RankLostError
from test_scheduler_core import prompt_of, request, run

TOL = 1e-5
NUM_KV_BLOCKS = 256
LOGPROBS = LogprobParams(return_logprob=True, logprob_start_len=0, top_logprobs_num=20, token_ids_logprob=(7, 3, 383))
FLAT = LogprobParams(return_logprob=True, logprob_start_len=2, top_logprobs_num=4, flat_prompt_top_logprobs=True)
OPTIONS = dict(max_running_requests=64, chunked_prefill_size=16, logprobs_mode="raw", seed=0)


@pytest.fixture(scope="module")
def groups():
    """(model dir, size, quantization) -> rank 0's runner of a live group; every group stopped at the end."""
    live = {}

    def get(path, size, quantization=None):
        if (path, size, quantization) not in live:
            config = SchedulerConfig(model=str(path), device="cpu", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=size,
                                     quantization=quantization)  # fmt: skip
            live[path, size, quantization] = load_leader(config)
        return live[path, size, quantization]

    yield get
    for runner in live.values():
        runner.leader.stop()


def whole(path):
    return load_model_runner(path, device="cpu", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS)


def small_prompt(seed: int, length: int) -> list[int]:
    return [t % 380 + 3 for t in prompt_of(seed, length)]


def mixed_requests():
    """Every kind of sampled row: greedy, T = 1, top-k, min-p, logit bias and min_tokens (drawn from the
    shards), and top-p and a penalty (gathered whole) in the same steps. "biased": id 300 (the last
    shard's) biased to win, held back by min_tokens as a stop token for 3 tokens, then it stops the request."""
    return [
        request("biased", small_prompt(8, 11), max_new_tokens=6, logit_bias=((300, 40.0),), min_new_tokens=3,
                stop_token_ids=(300,), logprobs=LOGPROBS),  # fmt: skip
        request("biased_sampled", small_prompt(9, 14), max_new_tokens=6, temperature=1.0, top_k=50, seed=3,
                logit_bias=((40, 4.0), (200, -100.0)), min_new_tokens=2, stop_token_ids=(40,), ignore_eos=True),  # fmt: skip
        request("greedy", small_prompt(1, 37), max_new_tokens=7, logprobs=LOGPROBS, ignore_eos=True),
        request("sampled", small_prompt(2, 21), max_new_tokens=7, temperature=1.0, seed=5, logprobs=LOGPROBS, ignore_eos=True),
        request("flat", small_prompt(3, 29), max_new_tokens=5, temperature=0.7, top_k=40, seed=9, logprobs=FLAT,
                ignore_eos=True),  # fmt: skip
        request("min_p", small_prompt(5, 12), max_new_tokens=6, temperature=1.5, min_p=0.05, seed=2, logprobs=LOGPROBS,
                ignore_eos=True),  # fmt: skip
        request("top_p", small_prompt(6, 9), max_new_tokens=6, temperature=1.0, top_p=0.8, seed=4, ignore_eos=True),
        request("penalty", small_prompt(7, 15), max_new_tokens=6, temperature=1.0, presence_penalty=0.5, seed=6,
                logprobs=LOGPROBS, ignore_eos=True),  # fmt: skip
    ]


def assert_same(expected, got, tol: float = TOL) -> None:
    assert set(got) == set(expected)
    for rid, a in expected.items():
        b = got[rid]
        assert b.tokens == a.tokens and b.finish == a.finish, rid
        for name in ("input_token", "input_top_values", "input_ids", "output_token", "output_top_values", "output_ids"):
            if getattr(a, name):
                np.testing.assert_allclose(b.cat(name), a.cat(name), atol=tol, equal_nan=True, err_msg=f"{rid} {name}")
        for name in ("input_top_ids", "output_top_ids"):
            if getattr(a, name):
                np.testing.assert_array_equal(b.cat(name), a.cat(name), err_msg=f"{rid} {name}")
        if a.flat is not None:
            np.testing.assert_allclose(b.flat[0], a.flat[0], atol=tol)
            np.testing.assert_array_equal(b.flat[1], a.flat[1])


@pytest.mark.parametrize(("family", "size"), [("qwen3", 2), ("llama", 4), ("qwen2", 2), ("qwen3-moe", 2), ("mixtral", 2)])
def test_sharded_model_serves_what_the_whole_model_serves(saved_family, groups, family, size):
    _, path = saved_family(family)
    expected = run(core_for(whole(path), **OPTIONS), mixed_requests())
    got = run(core_for(groups(path, size), **OPTIONS), mixed_requests())
    assert_same(expected, got)
    assert whole(path).model.tp is None and all(layer.tp is None for layer in whole(path).model.model.layers)  # TP = 1: no hook
    assert len(got["greedy"].cat("input_token")) == 37 and got["greedy"].cat("input_top_ids").shape[-1] == 20
    assert got["biased"].tokens[3] == 300 and 300 not in got["biased"].tokens[:3]


@pytest.fixture
def gathered(monkeypatch) -> list[int]:
    """The number of rows of each whole-vocabulary gather (`TensorParallel.gather_vocab`) on rank 0."""
    rows = []
    whole_rows = TensorParallel.gather_vocab
    monkeypatch.setattr(TensorParallel, "gather_vocab", lambda self, logits: rows.append(logits.shape[0]) or whole_rows(self, logits))
    return rows


def test_only_rows_that_need_the_whole_row_are_gathered(saved_family, groups, gathered):
    """Prompt and output logprobs and the sampled tokens of greedy, T = 1, top-k, min-p, logit bias and
    min_tokens rows come from every shard's statistics (`TensorParallel.logprob_columns`,
    `TensorParallel.sample`); the top-p and penalty requests' rows alone are gathered whole, in the same steps."""
    _, path = saved_family("qwen3")
    options = {**OPTIONS, "chunked_prefill_size": 256}
    got = run(core_for(groups(path, 2), **options), mixed_requests())
    assert sum(gathered) == 12 and len(got["greedy"].cat("input_token")) == 37  # top_p's 6 tokens, penalty's 6
    assert_same(run(core_for(whole(path), **options), mixed_requests()), got)


@pytest.mark.parametrize("layout", ["block", "channel", "quantized at load"])
def test_fp8_shards_with_its_scales(saved_family, groups, tmp_path, layout):
    """Block-wise scales sliced with their tiles (rows, or a row-parallel rank's columns), per-row
    scales with their rows (whole on a row-parallel rank), `--quantization fp8`'s per-row scales from
    the whole row's amax (over every rank's columns): TP = 2 serves what TP = 1 serves."""
    from tests.services.scheduler.model.test_fp8 import write_fp8_checkpoint

    path, quantization = saved_family("qwen3")[1], "fp8"
    if layout != "quantized at load":
        path, quantization = tmp_path / "fp8", None
        write_fp8_checkpoint(saved_family("qwen3")[1], path, layout, block=16)
    one = load_model_runner(path, device="cpu", dtype=torch.float32, num_kv_blocks=NUM_KV_BLOCKS, quantization=quantization)
    runner = groups(path, 2, quantization)
    assert_same(run(core_for(one, **OPTIONS), mixed_requests()), run(core_for(runner, **OPTIONS), mixed_requests()))
    down = runner.model.model.layers[0].mlp.down_proj
    assert isinstance(down, Fp8Linear) and down.weight.shape == (64, 48) and down.scale.shape == ((4, 3) if layout == "block" else (64,))
    if quantization:
        torch.testing.assert_close(down.scale, one.model.model.layers[0].mlp.down_proj.scale, atol=0, rtol=0)


def test_preemption_and_forks_match_tp1(saved_family, groups):
    _, path = saved_family("qwen3")
    prompts = [small_prompt(20 + i, 2 + 3 * i) for i in range(4)]
    requests = lambda: [request(f"r{i}", prompts[i % 4], max_new_tokens=14, ignore_eos=True) for i in range(32)]  # noqa: E731
    expected = run(core_for(whole(path), **{**OPTIONS, "chunked_prefill_size": 64}), requests())
    core = core_for(groups(path, 2), **{**OPTIONS, "num_blocks": 5, "chunked_prefill_size": 64})
    assert_same(expected, run(core, requests()))
    assert core.num_preemptions > 0

    first = request("f", small_prompt(7, 35), max_new_tokens=6, temperature=1.0, seed=3, logprobs=LOGPROBS)
    forked = dataclasses.replace(first, choices=(ForkedChoice("f.1", "detok", 4), ForkedChoice("f.2", "detok", 8)))
    assert_same(run(core_for(whole(path), **OPTIONS), [forked]), run(core_for(groups(path, 2), **OPTIONS), [forked]))


def test_a_killed_rank_fails_the_step_clearly(saved_family):
    _, path = saved_family("qwen3")
    runner = load_leader(SchedulerConfig(model=str(path), device="cpu", num_kv_blocks=NUM_KV_BLOCKS, tensor_parallel_size=2))
    try:
        core = core_for(runner, **OPTIONS)
        core.add(request("a", small_prompt(4, 40), max_new_tokens=20, ignore_eos=True))
        core.step()  # the first prompt chunk ran on both ranks
        follower = runner.leader.followers[0]
        os.kill(follower.pid, signal.SIGKILL)
        follower.join(timeout=30)
        with pytest.raises(RankLostError, match="tensor-parallel rank 1 of 2 exited with code -9"):
            for _ in range(10):
                core.step()
    finally:
        runner.leader.stop()


def test_vocabulary_shards_pad_the_last_rank_and_concatenate_to_the_whole(saved_family):
    config = dataclasses.replace(ModelConfig.from_pretrained(saved_family("qwen3")[1]), vocab_size=10)
    full = torch.arange(30.0).view(10, 3)
    shards = [TensorParallel(rank, 4, None, config).shard("lm_head.weight", full) for rank in range(4)]
    assert [s.shape[0] for s in shards] == [3, 3, 3, 3] and shards[3][1:].eq(0).all()
    assert torch.equal(torch.cat(shards)[:10], full)
    kv = torch.arange(2 * 32.0).view(2 * 32, 1)  # 2 KV heads of head_dim 32 over 4 ranks: each kept by 2
    parts = [TensorParallel(rank, 4, None, config).shard("model.layers.0.self_attn.k_proj.weight", kv) for rank in range(4)]
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3]) and torch.equal(torch.cat(parts[1:3]), kv)


@pytest.mark.parametrize("load_format", ["auto", "dummy"])
def test_a_drafter_shard_is_its_rank_s_slice_of_the_whole_drafter(load_format):
    """Read from its checkpoint or drawn at random, each rank's drafter holds its heads' rows of q/k/v
    (the 2 KV heads over 4 ranks: each kept by 2), its columns of o/down, its vocabulary rows of W2,
    and fc, W1 and the confidence head whole."""
    from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL
    from services.scheduler.spec.dspark_loader import load_drafter

    target = ModelConfig.from_pretrained(BUNDLED_MODEL)
    embed, head = torch.nn.Embedding(target.vocab_size, target.hidden_size), torch.zeros(target.vocab_size, target.hidden_size)
    load = lambda tp=None: load_drafter(BUNDLED_DRAFT_MODEL, embed, head, target, load_format=load_format, seed=3, tp=tp)  # noqa: E731
    whole = dict(load().named_parameters())
    for rank in range(4):
        shard = dict(load(TensorParallel(rank, 4, None, target)).named_parameters())
        layer = "layers.1.self_attn."
        assert torch.equal(shard[layer + "q_proj.weight"], whole[layer + "q_proj.weight"].chunk(4)[rank])
        assert torch.equal(shard[layer + "k_proj.weight"], whole[layer + "k_proj.weight"].chunk(2)[rank // 2])
        assert torch.equal(shard[layer + "o_proj.weight"], whole[layer + "o_proj.weight"].chunk(4, dim=1)[rank])
        assert torch.equal(shard["layers.0.mlp.down_proj.weight"], whole["layers.0.mlp.down_proj.weight"].chunk(4, dim=1)[rank])
        assert torch.equal(shard["markov_head.markov_w2.weight"], whole["markov_head.markov_w2.weight"].chunk(4)[rank])
        for name in ("fc.weight", "markov_head.markov_w1.weight", "confidence_head.proj.weight", layer + "k_norm.weight"):
            assert torch.equal(shard[name], whole[name]), name


def test_unshardable_models_are_refused_in_one_line(saved_family, tmp_path):
    import json

    from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL

    config = ModelConfig.from_pretrained(saved_family("qwen3")[1])
    check_shardable(config, 1)
    with pytest.raises(TensorParallelError, match="must divide the 4 attention heads"):
        check_model(SchedulerConfig(model=str(saved_family("qwen3")[1]), tensor_parallel_size=3))  # before any spawn
    draft = json.loads((BUNDLED_DRAFT_MODEL / "config.json").read_text()) | {"intermediate_size": 510}
    (tmp_path / "config.json").write_text(json.dumps(draft))
    with pytest.raises(TensorParallelError, match="the intermediate size 510"):  # the drafter is sharded too
        check_model(SchedulerConfig(model=str(BUNDLED_MODEL), speculative_algorithm="dspark", draft_model=str(tmp_path),
                                    tensor_parallel_size=4))  # fmt: skip
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="--tensor-parallel-size 2 needs 2 GPUs"):
            check_model(SchedulerConfig(model=str(saved_family("qwen3")[1]), device="cuda", tensor_parallel_size=2))
    with pytest.raises(TensorParallelError, match=r"each rank's projections \(64, 32, 48\) x \(64, 48\) are not whole FP8 tiles of 32 x 32"):
        check_shardable(dataclasses.replace(config, quantization=Fp8Scheme(block=(32, 32))), 2)
    moe = dataclasses.replace(ModelConfig.from_pretrained(saved_family("qwen3-moe")[1]), moe_intermediate_size=30)
    with pytest.raises(TensorParallelError, match="the intermediate size 30"):
        check_shardable(moe, 4)
    with pytest.raises(TensorParallelError, match="FP8 MoE checkpoints are not sharded yet"):
        check_shardable(dataclasses.replace(moe, moe_intermediate_size=32, quantization=Fp8Scheme(block=None)), 2)


DSPARK = dict(device="cpu", dtype="float32", num_kv_blocks=NUM_KV_BLOCKS, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def dspark_groups():
    """size -> the bundled pair's DSpark core on that many ranks, every rank drafting on its shard of
    the drafter (`dspark_loader.shard_drafter`); every group stopped at the end."""
    from services.models import BUNDLED_MODEL
    from services.scheduler.build import build_core

    live = {}

    def get(size):
        if size not in live:
            live[size] = build_core(SchedulerConfig(model=str(BUNDLED_MODEL), speculative_algorithm="dspark",
                                                    tensor_parallel_size=size, **DSPARK))  # fmt: skip
        return live[size]

    yield get
    for core in live.values():
        core.worker.runner.leader.stop()


def recorded_drafts(core, monkeypatch) -> dict[str, list[list[int]]]:
    """rid -> every block rank 0's proposer drafts for it from now on, in order."""
    drafts, propose = {}, core.worker.proposer.propose

    def recording(request):
        proposal = propose(request)
        for rid, block in zip(request.rids, proposal.tokens.tolist(), strict=True):
            drafts.setdefault(rid, []).append(block)
        return proposal

    monkeypatch.setattr(core.worker.proposer, "propose", recording)
    return drafts


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_dspark_drafts_and_serves_what_tp1_does(dspark_groups, gathered, monkeypatch, size):
    """Every rank drafts on its shard (its draft heads, its rows of W2 and of the target's LM head;
    4 ranks: the drafter's 2 KV heads replicated): the greedy blocks, argmax-merged from the shards,
    are TP = 1's blocks, accepted on argmaxes merged from the target's shards. Only the sampled
    request's rows are gathered whole: one drafting row per slot, and its verify blocks of K + 1 = 8.
    "b" (greedy, id 17 biased up and a stop token held back by min_tokens for 5 tokens) is verified on
    the shards too, each verify row with the ids min_tokens holds back after the drafts before it."""
    from services.models import BUNDLED_MODEL
    from services.scheduler.build import build_core

    prompts = [[(7 * i + 13 * j) % 4000 + 3 for j in range(9 + 5 * i)] for i in range(3)]
    requests = lambda: [request(f"d{i}", p, max_new_tokens=12, logprobs=LOGPROBS, ignore_eos=True)  # noqa: E731
                        for i, p in enumerate(prompts)] + [request("s", prompts[1], max_new_tokens=12, temperature=1.0, seed=7,
                                                                   ignore_eos=True),
                                                           request("b", prompts[2], max_new_tokens=12, logit_bias=((17, 3.0),),
                                                                   min_new_tokens=5, stop_token_ids=(17,), ignore_eos=True)]  # fmt: skip
    one = build_core(SchedulerConfig(model=str(BUNDLED_MODEL), speculative_algorithm="dspark", **DSPARK))
    expected_drafts, expected = recorded_drafts(one, monkeypatch), run(one, requests())
    core = dspark_groups(size)
    edited, sample = [], TensorParallel.sample
    monkeypatch.setattr(TensorParallel, "sample", lambda tp, logits, draws: edited.extend(d.blocked for d in draws) or sample(tp, logits, draws))
    drafts, spec = recorded_drafts(core, monkeypatch), run(core, requests())
    assert (17,) in edited and () in edited and spec["b"].tokens[-1] == 17 and 17 not in spec["b"].tokens[:5]
    greedy = lambda found: {rid: v for rid, v in found.items() if rid != "s"}  # noqa: E731
    assert_same(greedy(expected), greedy(spec), tol=1e-4)
    assert greedy(drafts) == greedy(expected_drafts) and sum(map(len, greedy(drafts).values())) >= 6
    assert 1 in gathered and all(rows == 1 or rows % 8 == 0 for rows in gathered) and len(spec["s"].tokens) == 12
    assert sum(r.spec_verify_ct or 0 for r in spec.values()) > 0
    drafter, heads = core.worker.proposer.drafter, one.worker.proposer.drafter.layers[0].self_attn.num_heads
    assert drafter.layers[0].self_attn.num_heads == heads // size and drafter.tp.size == size
    assert drafter.markov_head.markov_w2.weight.shape[0] == drafter.target.lm_head_weight.shape[0] == 4096 // size


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (NCCL)")
def test_sharded_dspark_on_two_gpus_drafts_what_one_gpu_drafts(monkeypatch):
    """CUDA: the drafter's collectives inside its graphs (`DraftGraphs`, NCCL) next to the target's;
    greedy blocks and tokens as on one GPU, sampled rows served too."""
    from services.models import BUNDLED_MODEL
    from services.scheduler.build import build_core

    prompts = [[(7 * i + 13 * j) % 4000 + 3 for j in range(9 + 5 * i)] for i in range(8)]
    requests = lambda: [request(f"g{i}", p, max_new_tokens=48, ignore_eos=True) for i, p in enumerate(prompts)] + [  # noqa: E731
        request(f"s{i}", p, max_new_tokens=48, temperature=1.0, seed=i, ignore_eos=True) for i, p in enumerate(prompts)]  # fmt: skip
    served = {}
    for size in (1, 2):
        core = build_core(SchedulerConfig(model=str(BUNDLED_MODEL), speculative_algorithm="dspark", device="cuda",
                                          dtype="float32", tensor_parallel_size=size))  # fmt: skip
        drafts = recorded_drafts(core, monkeypatch)
        try:
            served[size] = drafts, run(core, requests())
        finally:
            if size > 1:
                core.worker.runner.leader.stop()
    greedy = lambda found: {rid: v for rid, v in found.items() if rid.startswith("g")}  # noqa: E731
    assert greedy(served[2][0]) == greedy(served[1][0]) and len(served[2][1]) == 16
    assert all(served[2][1][rid].tokens == served[1][1][rid].tokens for rid in greedy(served[1][1]))


def test_dspark_on_two_ranks_samples_the_target_distribution(dspark_groups):
    """T = 1, lossless: the first token (drawn from the shards) and the second (the accept rule over
    a drafted block, its target rows gathered) follow the target's distributions, the second given
    the commonest first. Chi-square p > 1e-4 on fixed seeds (`spec/chi_square.py`)."""
    from services.models import BUNDLED_MODEL
    from tests.plain_forward import reference_logprobs
    from tests.services.scheduler.spec.chi_square import pooled_p_value

    prompt, num_samples = [(11 * j) % 4000 + 3 for j in range(7)], 600
    asks = [request(f"s{i}", prompt, max_new_tokens=2, temperature=1.0, seed=i, ignore_eos=True) for i in range(num_samples)]
    got = run(dspark_groups(2), asks)
    tokens = torch.tensor([got[f"s{i}"].tokens for i in range(num_samples)])  # [N, 2]
    reference = load_model_runner(BUNDLED_MODEL, device="cpu", dtype=torch.float32, num_kv_blocks=4)
    first = reference_logprobs(reference, prompt)[-1].exp()  # [V]
    common = int(tokens[:, 0].mode().values)
    second = reference_logprobs(reference, [*prompt, common])[-1].exp()
    assert pooled_p_value(tokens[:, 0], first) > 1e-4
    assert pooled_p_value(tokens[tokens[:, 0] == common, 1], second) > 1e-4
    assert (tokens[:, 0] == common).sum() >= 100 and len(set(tokens[:, 1].tolist())) > 5
    assert sum(r.spec_verify_ct or 0 for r in got.values()) >= num_samples  # every second token verified a block


def on_threads(config: ModelConfig, logits: torch.Tensor, call, size: int = 2) -> dict:
    """call(tp, shard) on `size` gloo ranks as threads of this process, each given its shard of
    `logits` [c, 11] (shards of ceil(11 / size), the last padded) -> {rank: what it returned}."""
    import datetime
    import threading

    import torch.distributed as dist

    from services.common.nats_server import free_port

    port, got, shard = free_port(), {}, -(-logits.shape[1] // size)
    padded = torch.nn.functional.pad(logits, (0, size * shard - logits.shape[1]))

    def rank(r: int) -> None:
        store = dist.TCPStore("127.0.0.1", port, size, r == 0, timeout=datetime.timedelta(seconds=30))
        tp = TensorParallel(r, size, dist.ProcessGroupGloo(store, r, size, datetime.timedelta(seconds=30)), config)
        got[r] = call(tp, padded[:, r * shard : (r + 1) * shard].contiguous())

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    return got


TIED = torch.tensor([[1.0, 3.0, 3.0, 0.5, 3.0, 2.0, 3.0, 3.0, -1.0, 2.0, 3.0],
                     [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])  # fmt: skip


def test_sharded_columns_equal_whole_rows_with_ties_across_shards(saved_family):
    """Ties inside and across shards keep the smaller ids."""
    from services.scheduler.logprobs import TopKKeys, logprob_columns

    config = dataclasses.replace(ModelConfig.from_pretrained(saved_family("qwen3")[1]), vocab_size=11)
    targets, ids = torch.tensor([6, 10]), torch.tensor([[0, 10], [5, 3]])
    expected = logprob_columns(TIED, targets, 5, ids, None, TopKKeys.build(11, "cpu"))
    got = on_threads(config, TIED, lambda tp, shard: tp.logprob_columns(shard, targets, 5, ids))
    for r in range(2):
        for column, want in zip(got[r], expected, strict=True):
            torch.testing.assert_close(column, want, atol=1e-6, rtol=0)
    assert got[0][2][0].tolist() == [1, 2, 4, 6, 7] and got[0][2][1].tolist() == [0, 1, 2, 3, 4]


def whole_row_draws(logits: torch.Tensor, params: list) -> torch.Tensor:
    """int64 [c]: what TP = 1's worker draws from whole rows (`sampling_weights`, `draw_noise`, `accept`
    with no drafts), the row at output position 0 for every row."""
    from services.scheduler.sampler import draw_noise, sampling_weights
    from services.scheduler.spec.accept import VerifyBlock, accept

    rows = logits.shape[0]
    noise, _ = draw_noise([p.seed if p.temperature > 0 else None for p in params], list(range(rows)), 0, 11, torch.device("cpu"))
    block = VerifyBlock(target_argmax=logits.argmax(dim=-1)[:, None], drafts=torch.zeros(rows, 0, dtype=torch.int64),
                        num_draft=torch.zeros(rows, dtype=torch.int64), is_greedy=torch.tensor([p.temperature <= 0 for p in params]),
                        target_weights=sampling_weights(logits, params)[:, None], uniforms=torch.zeros(rows, 0), noise=noise)  # fmt: skip
    return accept(block)[1]


def test_sharded_draws_are_the_whole_rows_draws(saved_family):
    """`TensorParallel.sample` over two shards draws, seed for seed, the token TP = 1 draws from the
    whole row: greedy ties to the smaller id, and top-k cutting through ties across shards, min-p and
    plain T = 1 rows over many seeds."""
    from contracts.scheduler import SamplingParams
    from services.scheduler.model.tensor_parallel import RowDraw

    config = dataclasses.replace(ModelConfig.from_pretrained(saved_family("qwen3")[1]), vocab_size=11)
    kinds = [dict(temperature=1.0), dict(temperature=0.8, top_k=3), dict(temperature=2.0, min_p=0.6), dict(temperature=1.0, top_k=6, min_p=0.2)]
    params = [SamplingParams(**kinds[i % len(kinds)], seed=i) for i in range(64)] + [SamplingParams(temperature=0.0)] * 2
    logits = torch.cat([TIED[:1].expand(64, -1), TIED])  # [66, 11]
    draws = tuple(RowDraw(p.temperature, p.seed, pos, p.top_k, p.min_p) for pos, p in enumerate(params))
    expected = whole_row_draws(logits, params)
    got = on_threads(config, logits, lambda tp, shard: tp.sample(shard, draws))
    assert got[0].tolist() == got[1].tolist() == expected.tolist()
    assert expected[-2:].tolist() == [1, 0] and set(expected[1:64:4].tolist()) <= {1, 2, 4}  # top-3 of the tied 3.0s: ids 1, 2, 4
    assert len(set(expected[:64:4].tolist())) > 2  # the T = 1 rows do draw


def near_ties(num_seeds: int, ulps: int) -> tuple[torch.Tensor, list]:
    """Rows [num_seeds * (2 ulps + 1), 11] whose race between id 2 (the first shard) and id 8 (another)
    is decided within `ulps` floats of a tie: logit 8 = 1 + log(E_8 / E_2) with logit 2 = 1, stepped
    -ulps..ulps floats, so w_8 / E_8 ~ w_2 / E_2 and a softmax sum added in another order (shards')
    can flip the winner. T = 1, each row's seed its own, the noise of `whole_row_draws`' positions."""
    from contracts.scheduler import SamplingParams
    from services.scheduler.sampler import draw_noise

    generator, rows, params = torch.Generator().manual_seed(0), [], []
    for seed in range(num_seeds):
        base = -4.0 - torch.rand(11, generator=generator) * 4  # [11], well below both racers
        base[2] = 1.0
        for step in range(-ulps, ulps + 1):
            noise, _ = draw_noise([seed], [len(rows)], 0, 11, torch.device("cpu"))  # [1, 11]
            tie = 1.0 + torch.log(noise[0, 8] / noise[0, 2])
            for _ in range(abs(step)):
                tie = torch.nextafter(tie, torch.tensor(float("inf") if step > 0 else float("-inf")))
            rows.append(base.clone().index_fill_(0, torch.tensor([8]), tie))
            params.append(SamplingParams(temperature=1.0, seed=seed))
    return torch.stack(rows), params


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_draws_equal_whole_rows_at_float_near_ties(saved_family, size):
    """The race runs on unnormalised weights exp(logit / T - max): no sum enters it, so at a race
    decided by an ulp, 2 and 4 shards (whose softmax sum adds in another order) draw TP = 1's id."""
    from services.scheduler.model.tensor_parallel import RowDraw

    config = dataclasses.replace(ModelConfig.from_pretrained(saved_family("qwen3")[1]), vocab_size=11)
    logits, params = near_ties(200, 3)  # [1400, 11]
    draws = tuple(RowDraw(p.temperature, p.seed, pos) for pos, p in enumerate(params))
    expected = whole_row_draws(logits, params)
    got = on_threads(config, logits, lambda tp, shard: tp.sample(shard, draws), size)
    assert ((expected == 2) | (expected == 8)).sum() > 0.95 * len(expected)  # the races are the near-tied ids'
    for r in range(size):
        assert got[r].tolist() == expected.tolist(), f"rank {r}: rows {(got[r] != expected).nonzero()[:, 0].tolist()} differ"
