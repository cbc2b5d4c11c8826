"""`sparkwire bench gpu-prefill` (ops/bench/gpu_prefill_profile.py) at toy size on CPU: every setting runs under the profiler and
kernel names land in the categories the H200 table is read by."""

from __future__ import annotations

import argparse
import json

from ops.bench.gpu_prefill_profile import SETTINGS, category, run
from tests.ops.bench.bench_cli import bench


def test_kernel_names_fall_into_their_categories():
    assert category("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64>") == "gemm"
    assert category("nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT") == "gemm"
    assert category("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3") == "attention"
    assert category("_varlen_kernel") == "attention" and category("_candidates_kernel") == "logprobs"
    assert category("_add_rms_norm_kernel") == "layer_fused" and category("_rotate_and_store_kernel") == "layer_fused"
    assert category("void at::native::index_elementwise_kernel<128, 4>") == "copy_gather"
    assert category("void at::native::vectorized_elementwise_kernel<4, at::native::silu>") == "elementwise"
    assert category("kernel_cutlass_kernel_flash_attncuteflash_fwd_sm90FlashAttentionForwardSm90_object_at") == "attention"
    assert category("something_new") == "other"


def test_every_setting_runs_on_cpu(tmp_path):
    out = tmp_path / "profile.json"
    run(argparse.Namespace(device="cpu", tiny=True, out=out, settings=None, repeats=1, sustained_gemm_s=0.0))
    result = json.loads(out.read_text())
    assert [(r["path"], r["chunk"], r["max_prefill_tokens"]) for r in result["rows"]] == [
        ("kernel", 64, None), ("kernel", 256, None), ("dense", 256, None), ("dense", 256, None), ("served", 64, 256), ("served", 64, 256),
        ("served_flash4", 64, 256), ("served_flash4", 64, 256)]  # fmt: skip
    measured, unavailable = result["rows"][:-2], result["rows"][-2:]
    assert len(result["rows"]) == len(SETTINGS) and all(r["seconds"] > 0 and r["plain_s"] > 0 and r["profiled_s"] > 0 for r in measured)
    assert all(r["unavailable"] == "flash4 needs CUDA, not cpu" and "seconds" not in r for r in unavailable)  # FA4 is CUDA's alone
    assert bench("gpu-prefill", "--device", "cpu", "--tiny", "--settings", "served", "--repeats", 3, "--out", out) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["path"] for r in rows] == ["served", "served"]
    assert all(len(r["seconds_runs"]) == 3 and r["seconds_runs"] == sorted(r["seconds_runs"]) and r["seconds"] == r["seconds_runs"][1] for r in rows)
