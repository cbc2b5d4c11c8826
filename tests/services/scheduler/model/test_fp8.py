"""FP8 weights (fp8.py) on CPU, where `Fp8Linear` dequantizes (W = W8 * scale, in fp32) and runs the
plain linear: a tiny Qwen3 checkpoint written here in the block-wise layout (weight_scale_inv per
32 x 32 tile, as Qwen3-FP8 ships 128 x 128), the per-channel one (weight_scale [N, 1]) and the
per-tensor one (a scalar weight_scale), and
`--quantization fp8` of its fp32 checkpoint, each served through the core against transformers
running the same dequantized weights: greedy ids and every logprob kind within 1e-4 (the bound: the
twin's computation is the reference's, so only fp32 summation order differs). Their error against
the unquantized model is FP8's and is not a bound we test. Other quant_methods are refused in one
line. The block-wise Triton kernel against the twin in the interpreter: test cases *interpreted*."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from services.scheduler.model.config import UnsupportedModelError
from services.scheduler.model.fp8 import FP8, FP8_MAX, Fp8Linear, quantize_weight_rows
from services.scheduler.model.loader import UnexpectedTensorError, load_model_runner
from tests.services.scheduler.model.test_families_core import check_against_transformers, serve
from tests.services.scheduler.model.triton_interpreter import (
    compile_for_hopper, compiles, interpreted, run_interpreted_cases, runs_the_interpreter,
)

BLOCK = 32
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_blocks(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] (multiples of block) -> (FP8 [N, K], scale per tile [N / b, K / b]), amax / 448."""
    n, k = weight.shape
    tiles = weight.view(n // block, block, k // block, block)
    scale = tiles.abs().amax(dim=(1, 3)) / FP8_MAX  # [N / b, K / b]
    q = (tiles / scale[:, None, :, None]).to(FP8).view(n, k)
    return q, scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    return q.float() * scale.repeat_interleave(block, 0).repeat_interleave(block, 1)


def write_fp8_checkpoint(src: Path, dst: Path, layout: str, block: int = BLOCK) -> dict[str, torch.Tensor]:
    """Copy the checkpoint at src with its projections in FP8 (`layout` "block" of `block` x `block`
    tiles, "channel" or "tensor"); returns the dequantized weights by name (the reference's)."""
    dst.mkdir()
    tensors, dequantized = load_file(str(src / "model.safetensors")), {}
    for name in [n for n in tensors if n.endswith(".weight") and n.split(".")[-2] in PROJECTIONS]:
        if layout == "block":
            q, scale = quantize_blocks(tensors[name], block)
            tensors[name.replace(".weight", ".weight_scale_inv")], dequantized[name] = scale, dequantize_blocks(q, scale, block)
        elif layout == "tensor":  # one scalar per projection: fused q/k/v keep each part's own
            scale = tensors[name].abs().max() / FP8_MAX
            q = (tensors[name] / scale).to(FP8)
            tensors[name.replace(".weight", ".weight_scale")], dequantized[name] = scale, q.float() * scale
        else:
            q, scale = quantize_weight_rows(tensors[name])
            tensors[name.replace(".weight", ".weight_scale")], dequantized[name] = scale[:, None], q.float() * scale[:, None]
        tensors[name] = q
    save_file(tensors, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    if layout == "block":
        config["quantization_config"]["weight_block_size"] = [block, block]
    (dst / "config.json").write_text(json.dumps(config))
    return dequantized


def with_weights(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    reference = copy.deepcopy(model)
    reference.load_state_dict(weights, strict=False)
    return reference


def loaded_with_weights(path: Path, weights: dict[str, torch.Tensor], tmp_path: Path) -> torch.nn.Module:
    """transformers' model of the checkpoint at path with `weights` (checkpoint names) in place: its
    loader maps per-expert tensors onto the fused expert parameters its MoE models hold."""
    import transformers

    (tmp_path / "reference").mkdir()
    save_file({**load_file(str(path / "model.safetensors")), **weights}, str(tmp_path / "reference" / "model.safetensors"))
    (tmp_path / "reference" / "config.json").write_text((path / "config.json").read_text())
    return transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "reference", dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["block", "channel", "tensor"])
def test_fp8_checkpoint_matches_its_dequantized_reference(saved_family, tmp_path, layout: str) -> None:
    model, path = saved_family("qwen3")
    dequantized = write_fp8_checkpoint(path, tmp_path / "fp8", layout)
    runner = load_model_runner(tmp_path / "fp8", num_kv_blocks=4)
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == FP8 and qkv.block == ((BLOCK, BLOCK) if layout == "block" else None)
    reference = with_weights(model, dequantized)
    results, prompts = serve(tmp_path / "fp8", graph_twins=layout == "block")
    for rid, result in results.items():
        check_against_transformers(reference, result, prompts[rid])


def test_quantization_fp8_quantizes_at_load(saved_family) -> None:
    model, path = saved_family("qwen3")
    runner = load_model_runner(path, num_kv_blocks=4, quantization="fp8")
    layer = runner.model.model.layers[1]
    assert isinstance(layer.mlp.down_proj, Fp8Linear) and layer.mlp.down_proj.weight.dtype == FP8
    assert not isinstance(runner.model.lm_head, Fp8Linear)
    weights = {name: param for name, param in model.state_dict().items() if name.split(".")[-2] in PROJECTIONS}
    dequantized = {}
    for name, weight in weights.items():
        q, scale = quantize_weight_rows(weight)
        dequantized[name] = q.float() * scale[:, None]
    torch.testing.assert_close(layer.mlp.down_proj.dequantized(torch.float32), dequantized["model.layers.1.mlp.down_proj.weight"])
    reference = with_weights(model, dequantized)
    core_results, prompts = serve_quantized(path)
    for rid, result in core_results.items():
        check_against_transformers(reference, result, prompts[rid])


def serve_quantized(path: Path):
    from services.scheduler.build import core_for
    from tests.services.scheduler.model.test_families_core import LOGPROBS, PROMPT_LENS, prompt
    from tests.services.scheduler.test_scheduler_core import request, run

    runner = load_model_runner(path, num_kv_blocks=48, kv_block_size=16, quantization="fp8")
    core = core_for(runner, max_running_requests=8, chunked_prefill_size=16, seed=0)
    prompts = {f"r{i}": prompt(n, seed=i) for i, n in enumerate(PROMPT_LENS)}
    return run(core, [request(rid, p, max_new_tokens=10, logprobs=LOGPROBS, ignore_eos=True) for rid, p in prompts.items()]), prompts


@pytest.mark.parametrize("method", ["awq", "gptq", "bitsandbytes"])
def test_other_quant_methods_are_refused_with_one_line(saved_family, tmp_path, method: str) -> None:
    _, path = saved_family("qwen3")
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": 128}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedModelError, match=f"quant_method '{method}' is not supported") as refused:
        load_model_runner(tmp_path, load_format="dummy", num_kv_blocks=4)
    assert "\n" not in str(refused.value) and "fp8" in str(refused.value)


def test_fp8_weights_without_their_config_are_refused(saved_family, tmp_path) -> None:
    _, path = saved_family("qwen3")
    write_fp8_checkpoint(path, tmp_path / "fp8", "block")
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "fp8" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnexpectedTensorError, match="weight_scale_inv|F8_E4M3"):
        load_model_runner(tmp_path / "fp8", num_kv_blocks=4)


@runs_the_interpreter
def test_triton_fp8_in_the_interpreter() -> None:
    run_interpreted_cases(__file__)


# Odd shapes: N not a multiple of any tile, K of no activation group; block-wise K = 300 is 10 steps of
# 32 and per-row K = 1100 is 9 of 128, so decode-sized steps split K (`test_decode_steps_split_k`).
KERNEL_SHAPES = {"block": (100, 300), "rows": (100, 1100)}


def odd_fp8_linear(layout: str, gen: torch.Generator) -> Fp8Linear:
    """An Fp8Linear [N, K] of KERNEL_SHAPES with random FP8 weights and scales."""
    n, k = KERNEL_SHAPES[layout]
    block = (BLOCK, BLOCK) if layout == "block" else None
    linear = Fp8Linear(k, n, bias=False, block=block, dtype=torch.float32)
    linear.weight.data = (torch.randn(n, k, generator=gen) * 100).to(FP8)
    linear.scale.data = torch.rand(linear.scale.shape, generator=gen) / 100 + 1e-3
    return linear


@interpreted
@pytest.mark.parametrize("num_rows", [1, 3, 64, 300])
@pytest.mark.parametrize("layout", ["block", "rows"])
def test_fp8_path_matches_its_w8a8_reference_interpreted(num_rows: int, layout: str, monkeypatch) -> None:
    # Fp8Linear's CUDA path (the Triton kernel, per-row weights past DECODE_ROWS torch._scaled_mm,
    # which runs on the CPU too) against `w8a8_reference`, on activations its quantization keeps exactly.
    from services.scheduler.model import fp8

    gen = torch.Generator().manual_seed(num_rows)
    linear = odd_fp8_linear(layout, gen)
    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: True)
    x = representable_activations(num_rows, linear.in_features, linear.activation_group(num_rows), gen)
    got, want = linear(x), linear.w8a8_reference(x)
    x_q, x_scale = fp8.quantize_groups(x, linear.activation_group(num_rows))
    torch.testing.assert_close(x_q.float() * x_scale.repeat_interleave(linear.activation_group(num_rows), 1)[:, : x.shape[1]], x)
    # fp32 sums in another order; cuBLAS's row-scaled GEMM writes bf16
    tolerance = 4e-3 if linear.on_cublas(num_rows) else 1e-5
    torch.testing.assert_close(got, want, atol=tolerance * float(want.abs().max()), rtol=tolerance)
    twin = torch.nn.functional.linear(x, linear.dequantized(torch.float32))  # the CPU path: activations as they are, here exact
    torch.testing.assert_close(got, twin, atol=tolerance * float(want.abs().max()), rtol=tolerance)


@interpreted
@pytest.mark.parametrize("layout", ["block", "rows"])
def test_one_token_gemv_matches_w8a8_and_the_tensor_core_kernel_interpreted(layout: str) -> None:
    # A one-token step takes `_fp8_gemv_kernel` (`tiles`' choice), under its default tiling, programs
    # of several rows (N = 100 is no multiple of 16) and a split K, against `w8a8_reference` and
    # against the tensor-core kernel given the same row.
    from services.scheduler.model import triton_fp8
    from services.scheduler.model.fp8 import ACTIVATION_GROUP

    linear = odd_fp8_linear(layout, torch.Generator().manual_seed(7))
    (n, k), group_n, block_k = KERNEL_SHAPES[layout], linear.block[0] if linear.block else 1, linear.activation_group(1)
    x = representable_activations(1, k, block_k, torch.Generator().manual_seed(8))
    plans = [triton_fp8.tiles(1, n, k, block_k, group_n=group_n),
             triton_fp8.gemv_tiles(n, k, block_k, group_n=group_n, block_n=16, step_k=2 * block_k),
             triton_fp8.gemv_tiles(n, k, block_k, group_n=group_n, block_n=4, step_k=block_k)]  # fmt: skip
    assert all(plan.block_m == triton_fp8.GEMV_ROWS for plan in plans) and plans[2].splits > 1 and plans[1].block_n == 16
    want = linear.w8a8_reference(x)
    tensor_cores = triton_fp8.fp8_linear(x, linear.weight, linear.scale, linear.block, triton_fp8.tiles(2, n, k, block_k))
    assert block_k == (BLOCK if layout == "block" else ACTIVATION_GROUP)
    for plan in plans:
        got = triton_fp8.fp8_linear(x, linear.weight, linear.scale, linear.block, plan)
        torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)
        torch.testing.assert_close(got, tensor_cores, atol=1e-5 * float(want.abs().max()), rtol=1e-5)


def representable_activations(num_rows: int, in_features: int, group: int, gen: torch.Generator) -> torch.Tensor:
    """FP8 values times a power of two per (row, group), each group holding a +-448: FP8 quantization
    per `group` columns gives them back exactly, whatever its rounding (Triton's interpreter converts
    fp32 to FP8 without carrying a round-up into the exponent, 31.5 -> 16; the GPU rounds to nearest)."""
    groups = -(-in_features // group)
    q = (torch.randn(num_rows, groups * group, generator=gen) * 100).to(FP8).float()
    q[:, ::group] = FP8_MAX
    scale = 2.0 ** torch.randint(-6, 2, (num_rows, groups), generator=gen).float()
    return (q * scale.repeat_interleave(group, dim=1))[:, :in_features].contiguous()


def test_decode_steps_split_k() -> None:
    from services.scheduler.model import triton_fp8
    from services.scheduler.model.fp8 import ACTIVATION_GROUP, DECODE_ROWS

    # the interpreted cases: decode-sized steps past one token split K, the 300-row one does not
    assert triton_fp8.tiles(3, *KERNEL_SHAPES["block"], BLOCK).splits > 1
    assert triton_fp8.tiles(64, *KERNEL_SHAPES["rows"], ACTIVATION_GROUP).splits > 1
    assert triton_fp8.tiles(300, *KERNEL_SHAPES["block"], BLOCK).splits == 1
    # Qwen3-8B's o_proj (4096 x 4096) on an H100: a decode step streams the weight from ~4 programs per SM (not 0.5)
    for num_rows in (1, DECODE_ROWS):
        plan = triton_fp8.tiles(num_rows, 4096, 4096, 128, num_sms=132, group_n=128)
        assert plan.splits * 4096 // plan.block_n >= 3 * 132 and plan.splits * plan.steps_per_split * 128 * plan.groups_per_step == 4096
    assert triton_fp8.tiles(2048, 4096, 4096, 128, num_sms=132).splits == 1


def test_one_token_steps_take_the_gemv() -> None:
    # batch-1 decode: the GEMV (rows of the weight per program, no tensor-core dot), unsplit at Qwen3-8B's
    # projections, its rows inside one block scale's; two tokens keep the tensor-core kernel
    from services.scheduler.model import triton_fp8

    for n, k in ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)):
        for group_n in (1, 128):
            plan = triton_fp8.tiles(1, n, k, 128, num_sms=132, group_n=group_n)
            assert plan.block_m == triton_fp8.GEMV_ROWS and plan.splits == 1 and 128 % plan.block_n == 0
            assert plan.steps_per_split * plan.groups_per_step * 128 == k and n // plan.block_n >= triton_fp8.GEMV_PROGRAMS_PER_SM * 132
        assert triton_fp8.tiles(2, n, k, 128, num_sms=132).block_m >= 16
    assert triton_fp8.gemv_tiles(100, 300, 32, group_n=48, block_n=32).block_n == 16  # the largest power of two dividing 48


@interpreted
@pytest.mark.parametrize("layout", ["block", "rows"])
def test_fused_input_stages_are_the_unfused_path_bitwise_interpreted(layout: str) -> None:
    # The GEMV's input stages against the unfused FP8 path in bf16, as served: the norm kernel (with and
    # without a residual) or the SiLU kernel writes its bf16 output, then `fp8_linear` runs the GEMV.
    # The same bits, output and residual, under the default tiling and a split K (each split sums the
    # row itself, one program writes the residual).
    from services.scheduler.model import triton_fp8
    from services.scheduler.model.triton_fused import add_rms_norm_triton, silu_mul_triton

    linear = odd_fp8_linear(layout, torch.Generator().manual_seed(9))
    (n, k), group_n, block_k = KERNEL_SHAPES[layout], linear.block[0] if linear.block else 1, linear.activation_group(1)
    gen = torch.Generator().manual_seed(10)
    x, residual, gate_up = (scale * torch.randn(1, width, generator=gen).to(torch.bfloat16) for scale, width in ((4, k), (4, k), (3, 2 * k)))
    norm_weight = (1.0 + 0.2 * torch.randn(k, generator=gen)).to(torch.bfloat16)
    split = triton_fp8.gemv_tiles(n, k, block_k, group_n=group_n, block_n=4, step_k=block_k)
    assert split.splits > 1
    for plan, added in ((None, residual), (split, None)):
        got, summed = triton_fp8.fp8_norm_gemv(x, added, norm_weight, 1e-6, linear.weight, linear.scale, linear.block, plan)
        normed, want_summed = add_rms_norm_triton(x, added, norm_weight, 1e-6)
        assert torch.equal(got, triton_fp8.fp8_linear(normed, linear.weight, linear.scale, linear.block, plan))
        assert torch.equal(summed, want_summed)
    got = triton_fp8.fp8_silu_gemv(gate_up, linear.weight, linear.scale, linear.block, split)
    assert torch.equal(got, triton_fp8.fp8_linear(silu_mul_triton(gate_up), linear.weight, linear.scale, linear.block, split))


def fp8_random_model(config, layout: str) -> torch.nn.Module:
    """test_fused_kernels' random model with its projections in FP8: per row, or block-wise in 16 x 16 tiles."""
    from services.scheduler.model.fp8 import Fp8Scheme, fp8_modules, quantize_linears
    from tests.services.scheduler.model.test_fused_kernels import random_model

    model = random_model(config)
    if layout == "rows":
        return quantize_linears(model)
    for parent, attribute, linear in list(fp8_modules(model, Fp8Scheme())):
        fp8 = Fp8Linear(linear.in_features, linear.out_features, False, (16, 16), torch.float32)
        fp8.weight.data, fp8.weight_scale_inv.data = quantize_blocks(linear.weight.detach(), 16)
        setattr(parent, attribute, fp8)
    return model


@interpreted
@pytest.mark.parametrize("layout", ["block", "rows"])
def test_interpreted_fp8_decode_step_takes_the_fused_gemvs(layout: str, make_pager, monkeypatch) -> None:
    # A tiny FP8 Qwen3 on the W8A8 path (as on CUDA), prefill then a one-token decode, fused kernels on
    # and off: at one token each layer's q/k/v and gate/up take the norm GEMV and down the SiLU GEMV
    # (none of triton_fused's float GEMVs), a prefill neither; the decode's logits and greedy ids are
    # the unfused runner's (torch's norm and SiLU, then each projection's GEMV: fp32 sums apart).
    from services.scheduler.model import fp8, triton_fp8, triton_fused
    from services.scheduler.model.kv_cache import PagedKVCache
    from services.scheduler.model.runner import ModelRunner
    from tests.services.scheduler.model.test_fused_kernels import tiny_config

    monkeypatch.setattr(fp8, "fp8_matmul_available", lambda device: True)
    launches = []
    for module, name in ((triton_fp8, "fp8_norm_gemv"), (triton_fp8, "fp8_silu_gemv"), (triton_fused, "norm_gemv_triton"),
                         (triton_fused, "silu_gemv_triton"), (triton_fused, "gemv_triton")):  # fmt: skip
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, lambda *args, _kernel=kernel, _name=name, **kw: launches.append(_name) or _kernel(*args, **kw))
    config = tiny_config("qwen3")
    model = fp8_random_model(config, layout)
    pager = make_pager(num_seqs=1, max_blocks_per_seq=4, block_size=4)
    steps, logits = [], []
    for fused in (False, True):
        runner = ModelRunner(copy.deepcopy(model), PagedKVCache(config, pager.num_blocks, 4, torch.float32, torch.device("cpu")))
        runner.fused_kernels = fused
        for batch in (pager.batch([(0, [5, 6, 7], 0)]), pager.batch([(0, [8], 3)])):
            launches.clear()
            hidden = runner.forward(batch).hidden_states
            steps.append(list(launches))
        logits.append(runner.compute_logits(hidden))
    per_layer = ["fp8_norm_gemv", "fp8_norm_gemv", "fp8_silu_gemv"]
    assert steps == [[], [], [], per_layer * config.num_hidden_layers]
    torch.testing.assert_close(logits[1], logits[0], atol=1e-4 * float(logits[0].abs().max()), rtol=1e-4)
    assert torch.equal(logits[1].argmax(-1), logits[0].argmax(-1))


@compiles
def test_fp8_kernels_compile_for_hopper() -> None:
    # FP8 tensor-core dots exist from sm_89 on: the interpreter cannot tell whether these tiles lower.
    from services.scheduler.model import triton_fp8, triton_matmul

    i32 = "i32"
    signature = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "out_ptr": "*fp32", "M": i32, "N": i32, "K": i32,
                 "steps_per_split": i32, "stride_x": i32, "stride_w": i32, "stride_ws_n": i32, "stride_ws_k": i32,
                 "stride_out_split": i32, "stride_out": i32}  # fmt: skip
    divisible = ("x_ptr", "w_ptr", "w_scale_ptr", "out_ptr", "N", "K", "stride_x", "stride_w", "stride_out_split", "stride_out")
    for group_n, num_rows, n, k in ((1, 1, 4096, 4096), (128, 1, 24576, 4096), (128, 3, 4096, 12288), (128, 64, 4096, 4096),
                                    (1, 64, 6144, 4096), (128, 300, 4096, 4096)):  # fmt: skip
        plan = triton_fp8.tensor_core_tiles(num_rows, n, k, 128)
        constants = {"GROUP_N": group_n, "FP8_LIMIT": FP8_MAX, "BLOCK_M": plan.block_m, "BLOCK_N": plan.block_n, "BLOCK_K": 128}
        assert compile_for_hopper(triton_fp8._fp8_linear_kernel, signature, constants, divisible, num_warps=4, num_stages=plan.num_stages)
    gemv = {"x_ptr": "*bf16", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32", "out_ptr": "*bf16", "N": i32, "K": i32, "steps_per_split": i32,
            "stride_w": i32, "stride_ws_n": i32, "stride_ws_k": i32, "stride_out_split": i32, "residual_ptr": "*bf16",
            "norm_weight_ptr": "*bf16", "residual_out_ptr": "*bf16", "eps": "fp32"}  # fmt: skip
    # Qwen3-8B's projections with their input stages: plain (o_proj), norm (q/k/v, gate/up; the first
    # layer's without a residual), SiLU (down)
    for group_n, n, k, stage in ((1, 4096, 4096, "plain"), (1, 6144, 4096, "norm"), (128, 6144, 4096, "first norm"),
                                 (128, 24576, 4096, "norm"), (128, 4096, 12288, "silu"), (128, 4096, 4096, "plain")):  # fmt: skip
        plan = triton_fp8.tiles(1, n, k, 128, num_sms=132, group_n=group_n)
        normed = stage.endswith("norm")
        constants = {"GROUP_N": group_n, "FP8_LIMIT": FP8_MAX, "BLOCK_N": plan.block_n, "GROUPS": plan.groups_per_step, "GROUP_K": 128,
                     "NORMED": normed, "HAS_RESIDUAL": stage == "norm", "GATED": stage == "silu", "HIDDEN": k if normed else 0,
                     "ROW_BLOCK": k if normed else 0}  # fmt: skip
        assert compile_for_hopper(triton_fp8._fp8_gemv_kernel, gemv, constants, ("x_ptr", "w_ptr", "out_ptr", "K", "stride_w"),
                                  num_warps=plan.num_warps, num_stages=plan.num_stages)  # fmt: skip
    sums = {"partial_ptr": "*fp32", "out_ptr": "*bf16", "numel": i32, "splits": i32}
    assert compile_for_hopper(triton_matmul._sum_splits_kernel, sums, {"BLOCK": triton_matmul.SUM_BLOCK}, num_warps=4)


@pytest.mark.parametrize("layout", ["block", "channel"])
def test_fp8_moe_checkpoint_matches_its_dequantized_reference(saved_family, tmp_path, layout: str) -> None:
    # Qwen3-MoE with every projection and expert in FP8 (Qwen3-30B-A3B-FP8's layout: experts.{e}.{gate,up,down}_proj.weight
    # and weight_scale_inv; the router stays float), through the core with its twin, against transformers
    # running the dequantized weights: within 1e-4, the bound of the dense case.
    from services.scheduler.model.moe import Experts

    model, path = saved_family("qwen3-moe")
    dequantized = write_fp8_checkpoint(path, tmp_path / "fp8", layout)
    assert any(".experts.3.up_proj.weight" in name for name in dequantized)
    runner = load_model_runner(tmp_path / "fp8", num_kv_blocks=4)
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.quantized and m.block == ((BLOCK, BLOCK) if layout == "block" else None) for m in experts)
    reference = loaded_with_weights(path, dequantized, tmp_path)
    results, prompts = serve(tmp_path / "fp8", graph_twins=False)
    for rid, result in results.items():
        check_against_transformers(reference, result, prompts[rid])


def test_quantization_fp8_quantizes_moe_experts(saved_family, tmp_path) -> None:
    from services.scheduler.model.moe import Experts

    model, path = saved_family("qwen3-moe")
    runner = load_model_runner(path, num_kv_blocks=4, quantization="fp8")
    experts = [m for m in runner.model.modules() if isinstance(m, Experts)]
    assert experts and all(m.quantized and m.down_proj_scale.shape == m.down_proj.shape[:2] for m in experts)
    weights = {name: weight for name, weight in load_file(str(path / "model.safetensors")).items() if name.split(".")[-2] in PROJECTIONS}
    dequantized = {}
    for name, weight in weights.items():
        q, scale = quantize_weight_rows(weight)
        dequantized[name] = q.float() * scale[:, None]
    reference = loaded_with_weights(path, dequantized, tmp_path)
    core_results, prompts = serve_quantized(path)
    for rid, result in core_results.items():
        check_against_transformers(reference, result, prompts[rid])


@interpreted
@pytest.mark.parametrize("layout", ["block", "rows"])
def test_fused_fp8_experts_match_the_twin_interpreted(layout: str) -> None:
    # The Triton MoE kernel on FP8 stacks (upcast per tile, scaled per step) against the twin on the dequantized ones.
    from services.scheduler.model.fp8 import dequantize, scale_shape
    from services.scheduler.model.moe import experts_reference, route
    from services.scheduler.model.triton_moe import fused_experts

    gen = torch.Generator().manual_seed(3)
    experts, hidden, inter, block = 6, 96, 64, (BLOCK, BLOCK) if layout == "block" else None
    stacks = [(torch.randn(experts, 2 * inter, hidden, generator=gen) * 100).to(FP8), (torch.randn(experts, hidden, inter, generator=gen) * 100).to(FP8)]
    scales = [torch.rand(scale_shape(stack.shape, block), generator=gen) / 1000 + 1e-4 for stack in stacks]
    x = torch.randn(7, hidden, generator=gen)
    weights, ids = route(torch.randn(7, experts, generator=gen), 2, renormalize=True)
    got = fused_experts(x, *stacks, weights, ids, (*scales, block))
    want = experts_reference(x, *(dequantize(stack, scale, block, torch.float32) for stack, scale in zip(stacks, scales)), weights, ids)
    torch.testing.assert_close(got, want, atol=1e-5 * float(want.abs().max()), rtol=1e-5)
