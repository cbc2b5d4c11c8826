"""The fused Triton kernels (`triton_fused.py`) against their torch twins in `llama.py`, one by one
and inside whole fp32 forwards (Qwen3 with q/k norms; Llama with attention biases), in Triton's CPU
interpreter (skipped without Triton; the test extras install it). The interpreter rounds fp32 to bf16 by truncation,
so only fp32 is compared here; bf16 is ops/bench/gpu_fused_check.py's, on the GPU."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import torch

from services.scheduler.model.config import ModelConfig
from services.scheduler.model.kv_cache import PagedKVCache
from services.scheduler.model.llama import CausalLM, RMSNorm, add_rms_norm, norm_linear, project, rope_cos_sin, silu_linear, silu_mul
from services.scheduler.model.registry import build_model
from services.scheduler.model.runner import ModelRunner
from tests.services.scheduler.model.triton_interpreter import INTERPRETED, interpreted, run_interpreted_cases, runs_the_interpreter

TOLERANCE = {"atol": 1e-5, "rtol": 1e-5}
SHAPE = {"vocab_size": 96, "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 128, "rms_norm_eps": 1e-6, "eos_token_id": 2}  # fmt: skip
FAMILIES = {
    "qwen3": {"architectures": ["Qwen3ForCausalLM"], "rope_theta": 1000000.0},  # q/k norms, no biases
    "llama": {"architectures": ["LlamaForCausalLM"], "rope_theta": 500000.0, "attention_bias": True},  # q/k/v/o biases
    # Gemma's norms and GeGLU stay on torch ops beside the fused RoPE/K-V write, GEMVs and attention
    # kernels' windows and soft-caps
    "gemma2": {"architectures": ["Gemma2ForCausalLM"], "sliding_window": 3, "attn_logit_softcapping": 2.0,
               "final_logit_softcapping": 5.0, "query_pre_attn_scalar": 8},
    "gemma3": {"architectures": ["Gemma3ForCausalLM"], "sliding_window": 3, "sliding_window_pattern": 2,
               "rope_local_base_freq": 100.0},  # q/k norms, a local and a global RoPE
}


def tiny_config(family: str) -> ModelConfig:
    return ModelConfig.from_dict({**SHAPE, **FAMILIES[family]})


def random_model(config: ModelConfig, seed: int = 0) -> CausalLM:
    """Every parameter random (norm weights around 1, biases too), so a misread weight or lane shows."""
    model = build_model(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in name else 0.3 * noise)
    return model


def test_runner_keeps_the_fused_kernels_off_on_cpu_and_sets_them_on_its_model() -> None:
    config = tiny_config("qwen3")
    runner = ModelRunner(random_model(config), PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu")))
    assert runner.fused_kernels is False and runner.model.fused_kernels is False
    runner.fused_kernels = True
    assert runner.model.fused_kernels is True


def test_the_fused_switch_refuses_to_change_under_captured_graphs() -> None:
    config = tiny_config("qwen3")
    runner = ModelRunner(random_model(config), PagedKVCache(config, 4, 4, torch.float32, torch.device("cpu")))
    runner.prepare_decode_graphs(ladder=(1,), max_blocks_per_seq=2)  # on the CPU: the padded twin, no capture
    with pytest.raises(RuntimeError, match="drop them first"):
        runner.fused_kernels = True
    runner.fused_kernels = False  # no change: allowed
    runner.drop_decode_graphs()
    runner.fused_kernels = True
    assert runner.model.fused_kernels is True


@pytest.mark.parametrize(("flag", "passed"), [(False, False), (True, None)])
def test_the_scheduler_flag_reaches_the_loader(flag, passed, monkeypatch) -> None:
    # --fused-kernels: on wherever Triton runs (None: CUDA with Triton); --no-fused-kernels: off everywhere
    from services.scheduler.config import SchedulerConfig
    from tests.services.scheduler.loader_options import loader_options

    assert loader_options(monkeypatch, SchedulerConfig(device="cpu", fused_kernels=flag))["fused_kernels"] is passed


def test_twin_without_residual_is_the_plain_norm_and_hands_x_on() -> None:
    norm = RMSNorm(48, 1e-6)
    x = torch.randn(3, 48)
    normed, residual = add_rms_norm(x, None, norm)
    assert residual is x and torch.equal(normed, norm(x))


@runs_the_interpreter
def test_fused_kernels_in_the_triton_interpreter() -> None:
    """The interpreted cases below, in a child pytest whose Triton starts in interpreter mode."""
    run_interpreted_cases(__file__)


@interpreted
@pytest.mark.parametrize("with_residual", [False, True])
def test_interpreted_add_rms_norm_matches_twin(with_residual) -> None:
    from services.scheduler.model.triton_fused import add_rms_norm_triton

    gen = torch.Generator().manual_seed(1)
    x, residual = torch.randn(5, 48, generator=gen), torch.randn(5, 48, generator=gen)  # 48: a masked row
    norm = RMSNorm(48, 1e-6)
    norm.weight.data.copy_(1.0 + 0.2 * torch.randn(48, generator=gen))
    residual = residual if with_residual else None
    with torch.no_grad():
        got, want = add_rms_norm_triton(x, residual, norm.weight, norm.eps), add_rms_norm(x, residual, norm)
    torch.testing.assert_close(got[0], want[0], **TOLERANCE)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the sum rounds once, as torch's add


@interpreted
def test_interpreted_row_norm_computes_gemmas_rounding_row_by_row() -> None:
    """`llama.norm_rows` on a Gemma norm (the deterministic mode's): (1 + w) in fp32, rounded once, as
    `GemmaRMSNorm`'s torch ops, and each row the same bits alone as among others."""
    from services.scheduler.model.gemma import GemmaRMSNorm
    from services.scheduler.model.llama import norm_rows

    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 7, 48, generator=gen).to(torch.bfloat16)  # [..., H]: rows of any leading shape
    norm = GemmaRMSNorm(48, 1e-6)
    norm.weight.data.copy_(0.3 * torch.randn(48, generator=gen))
    with torch.no_grad():
        got = norm_rows(x, norm)
        assert got.dtype == torch.bfloat16 and torch.equal(norm_rows(x[1, 3:4], norm), got[1, 3:4])
        torch.testing.assert_close(got.float(), norm(x).float(), atol=1e-2, rtol=1e-2)  # bf16: one rounding apart at most


@interpreted
def test_interpreted_silu_mul_matches_twin() -> None:
    from services.scheduler.model.triton_fused import silu_mul_triton

    gate_up = 3 * torch.randn(3, 2 * 1500, generator=torch.Generator().manual_seed(2))  # 2 column blocks, the last masked
    torch.testing.assert_close(silu_mul_triton(gate_up), silu_mul(gate_up), **TOLERANCE)


@interpreted
@pytest.mark.parametrize("tiles", [None, (8, 16, 4)])  # None: gemv_tiles' own; 8 x 16: 5 row programs, the last masked, 3 column steps
@pytest.mark.parametrize(("with_residual", "with_bias"), [(False, False), (True, False), (True, True)])
def test_interpreted_norm_gemv_matches_twin(tiles, with_residual, with_bias) -> None:
    from services.scheduler.model.triton_fused import norm_gemv_triton

    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(1, 48, generator=gen), torch.randn(1, 48, generator=gen)
    norm, linear = RMSNorm(48, 1e-6), torch.nn.Linear(48, 37, bias=with_bias)
    with torch.no_grad():
        norm.weight.copy_(1.0 + 0.2 * torch.randn(48, generator=gen))
        residual = residual if with_residual else None
        got = norm_gemv_triton(x, residual, norm.weight, norm.eps, linear.weight, linear.bias, tiles)
        want = norm_linear(x, residual, norm, linear)
    torch.testing.assert_close(got[0], want[0], **TOLERANCE)
    torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)  # the new residual: the same one rounding


@interpreted
@pytest.mark.parametrize("tiles", [None, (8, 16, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_silu_gemv_matches_twin(tiles, with_bias) -> None:
    from services.scheduler.model.triton_fused import silu_gemv_triton

    gen = torch.Generator().manual_seed(6)
    gate_up, linear = 3 * torch.randn(1, 2 * 40, generator=gen), torch.nn.Linear(40, 37, bias=with_bias)  # 40: a masked step
    with torch.no_grad():
        got, want = silu_gemv_triton(gate_up, linear.weight, linear.bias, tiles), silu_linear(gate_up, linear)
    torch.testing.assert_close(got, want, **TOLERANCE)


@interpreted
@pytest.mark.parametrize("tiles", [None, (8, 16, 4)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_interpreted_gemv_matches_twin(tiles, with_bias) -> None:
    from services.scheduler.model.triton_fused import gemv_triton

    gen = torch.Generator().manual_seed(7)
    x, linear = torch.randn(1, 40, generator=gen), torch.nn.Linear(40, 37, bias=with_bias)
    with torch.no_grad():
        got, want = gemv_triton(x, linear.weight, linear.bias, tiles), project(x, linear)
    torch.testing.assert_close(got, want, **TOLERANCE)


@interpreted
def test_interpreted_gemv_kernels_refuse_more_than_one_row() -> None:
    from services.scheduler.model.triton_fused import gemv_triton, norm_gemv_triton, silu_gemv_triton

    linear = torch.nn.Linear(48, 8)
    with pytest.raises(ValueError, match="one row"):
        norm_gemv_triton(torch.randn(2, 48), None, torch.ones(48), 1e-6, linear.weight, None)
    with pytest.raises(ValueError, match="one row"):
        silu_gemv_triton(torch.randn(2, 96), linear.weight, None)
    with pytest.raises(ValueError, match="one row"):
        gemv_triton(torch.randn(2, 48), linear.weight, None)


@interpreted
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("heads_per_program", [1, 4, 8])  # 6 rotated heads: one a program, a masked second program, all in one masked
def test_interpreted_rotate_and_store_matches_twin(family, heads_per_program, monkeypatch) -> None:
    # q, and the whole cache after the write: the tokens' slots (in shuffled blocks, one in the trash
    # block as a padded graph row writes) hold the same k and v, every other slot (other layers too) is untouched.
    config = tiny_config(family)
    model = random_model(config)
    attention = model.model.layers[1].self_attn
    gen = torch.Generator().manual_seed(3)
    num_tokens, block_size = 5, 4
    qkv = torch.randn(num_tokens, (4 + 2 * 2) * 16, generator=gen)
    rope = rope_cos_sin(model.rope_inv_freq, torch.tensor([0, 7, 8, 30, 0]), torch.float32)
    slots = torch.tensor([13, 2, 3, 9, 6 * block_size + 1])  # block 6: the trash block of a 6-block cache
    caches = [PagedKVCache(config, 6, block_size, torch.float32, torch.device("cpu")) for _ in range(2)]
    for cache in caches:
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=torch.Generator().manual_seed(4)))
    import functools

    from services.scheduler.model import triton_fused

    launch = functools.partial(triton_fused.rotate_and_store_triton, heads_per_program=heads_per_program)
    monkeypatch.setattr(triton_fused, "rotate_and_store_triton", launch)
    with torch.no_grad():
        want = attention.rotate_and_store(qkv, rope, slots, caches[0])
        got = attention.rotate_and_store(qkv, rope, slots, caches[1], fused=True)
    torch.testing.assert_close(got, want, **TOLERANCE)
    torch.testing.assert_close(caches[1].kv, caches[0].kv, **TOLERANCE)


@interpreted
@pytest.mark.parametrize("family", list(FAMILIES))
def test_interpreted_model_forward_fused_equals_unfused(family, make_pager) -> None:
    # A prefill of two sequences (one layer captured, as DSpark asks) through the padded ragged-graph
    # twin, then a decode of both through the padded decode-graph twin (padded tokens and rows write
    # the trash block): hidden states, captures and the whole cache agree.
    config = tiny_config(family)
    pager = make_pager(num_seqs=3, max_blocks_per_seq=4, block_size=4, seed=1)
    runners = [ModelRunner(random_model(config), PagedKVCache(config, pager.num_blocks, 4, torch.float32,
                                                              torch.device("cpu"))) for _ in range(2)]  # fmt: skip
    runners[1].fused_kernels = True
    prefill = pager.batch([(0, [5, 6, 7, 8, 9], 0), (1, [10, 11, 12], 0)], capture_layers=(0,))
    prefill = dataclasses.replace(prefill, host_query_lens=(5, 3), host_seq_lens=(5, 3))
    decode = pager.batch([(0, [40], 5), (1, [41], 3)])
    single = pager.batch([(0, [42], 6)])  # one token: the one-token GEMVs (a batch-1 graph of the ladder)
    outputs = []
    for runner in runners:
        runner.prepare_ragged_graphs((4,), (12,), max_blocks_per_seq=4, capture=False, capture_layers=(0,))
        runner.prepare_decode_graphs(ladder=(1, 4), max_blocks_per_seq=4, capture=False)
        assert runner.ragged_graphs.fits(prefill) and runner.decode_graphs.fits(decode)
        outputs.append((runner.forward(prefill), runner.forward(decode), runner.forward(single)))
    (want_prefill, want_decode, want_single), (got_prefill, got_decode, got_single) = outputs
    torch.testing.assert_close(got_prefill.hidden_states, want_prefill.hidden_states, **TOLERANCE)
    torch.testing.assert_close(got_prefill.captured, want_prefill.captured, **TOLERANCE)
    torch.testing.assert_close(got_decode.hidden_states, want_decode.hidden_states, **TOLERANCE)
    torch.testing.assert_close(got_single.hidden_states, want_single.hidden_states, **TOLERANCE)
    torch.testing.assert_close(runners[1].kv_cache.kv, runners[0].kv_cache.kv, **TOLERANCE)


@interpreted
@pytest.mark.parametrize(("tokens", "gemv_launches"), [(1, 2 * 4), (2, 0)])  # per layer: norm_gemv twice, o_proj's, silu_gemv
def test_interpreted_one_token_takes_the_gemvs_and_more_tokens_do_not(tokens, gemv_launches, make_pager, monkeypatch) -> None:
    from services.scheduler.model import triton_fused

    launches = []
    for name in ("norm_gemv_triton", "gemv_triton", "silu_gemv_triton"):
        kernel = getattr(triton_fused, name)
        monkeypatch.setattr(triton_fused, name, lambda *args, _kernel=kernel, **kw: launches.append(1) or _kernel(*args, **kw))
    config = tiny_config("qwen3")
    pager = make_pager(num_seqs=2, max_blocks_per_seq=4, block_size=4, seed=1)
    runner = ModelRunner(random_model(config), PagedKVCache(config, pager.num_blocks, 4, torch.float32, torch.device("cpu")))
    runner.fused_kernels = True
    runner.forward(pager.batch([(index, [40 + index], 3) for index in range(tokens)]))
    assert len(launches) == gemv_launches


@pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")
def test_kernels_compile_for_the_h200_at_the_8b_shape() -> None:
    # The interpreter runs the kernels' Python; this runs Triton's compiler down to an sm_90 cubin (no
    # device needed), so what only the compiler refuses (types across branches, layouts) fails here.
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from services.scheduler.model import triton_fused

    bf16, i32 = "*bf16", "i32"
    norm = {"x_ptr": bf16, "residual_ptr": bf16, "weight_ptr": bf16, "out_ptr": bf16, "residual_out_ptr": bf16, "eps": "fp32",
            "stride_x": i32, "stride_r": i32, "stride_o": i32, "stride_ro": i32}  # fmt: skip
    rope = {"qkv_ptr": bf16, "cos_ptr": bf16, "sin_ptr": bf16, "slot_ptr": "*i64", "q_out_ptr": bf16, "key_cache_ptr": bf16,
            "value_cache_ptr": bf16, "q_weight_ptr": bf16, "k_weight_ptr": bf16, "eps": "fp32", "stride_qkv": i32,
            "stride_cos": i32, "stride_sin": i32, "stride_qo": i32, "stride_cache_block": i32, "stride_cache_slot": i32}  # fmt: skip
    silu = {"gate_up_ptr": bf16, "out_ptr": bf16, "stride_in": i32, "stride_out": i32}
    norm_gemv = {"x_ptr": bf16, "residual_ptr": bf16, "norm_weight_ptr": bf16, "weight_ptr": bf16, "bias_ptr": bf16,
                 "out_ptr": bf16, "residual_out_ptr": bf16, "eps": "fp32", "stride_w": i32, "N": i32}  # fmt: skip
    gemv = {"in_ptr": bf16, "weight_ptr": bf16, "bias_ptr": bf16, "out_ptr": bf16, "stride_w": i32, "N": i32}
    kernels = [
        *((triton_fused._add_rms_norm_kernel, norm, {"HIDDEN": 4096, "BLOCK": 4096, "HAS_RESIDUAL": has, "UNIT_OFFSET": gemma})
          for has in (False, True) for gemma in (False, True)),
        *((triton_fused._rotate_and_store_kernel, rope,
           {"NUM_HEADS": 32, "NUM_KV_HEADS": 8, "HEAD_DIM": 128, "BLOCK_SIZE": 16, "HEADS_PER_PROGRAM": per_program, "QK_NORM": qk})
          for qk in (False, True) for per_program in (1, triton_fused.ROPE_HEADS_PER_PROGRAM, 16)),  # 16: the last masked
        (triton_fused._silu_mul_kernel, silu, {"INTERMEDIATE": 12288, "BLOCK": 1024}),
        *((triton_fused._norm_gemv_kernel, norm_gemv, {"HIDDEN": 4096, "BLOCK_N": 8, "BLOCK_K": 512, "HAS_RESIDUAL": has,
                                                       "HAS_BIAS": bias}) for has in (False, True) for bias in (False, True)),
        *((triton_fused._gemv_kernel, gemv, {"K": 12288, "BLOCK_N": 8, "BLOCK_K": 512, "GATED": gated, "HAS_BIAS": bias})
          for gated in (False, True) for bias in (False, True)),
    ]  # fmt: skip
    for kernel, signature, constants in kernels:
        source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants)
        compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32))
        assert compiled.asm["cubin"], kernel
