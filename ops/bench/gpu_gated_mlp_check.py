"""The MLP's first half of a long prefill on one GPU: cuBLAS's gate/up GEMM then the SiLU x up kernel
(`triton_fused.silu_mul_triton`, as served) against one quack GEMM with the SiLU x up in its
epilogue (`quack.gemm_interface.gemm_gated_out`, the optional `flash4` extra's dependency), which
never writes the [T, 2I] gate/up rows (issue 12, point 5: SiLU x up alone was 20.7 ms of a 32k
prompt's 1.31 s, at the card's copy bandwidth).

The Qwen3-8B MLP shape (hidden 4096, intermediate 12288, bf16), random inputs and weights, per
number of tokens (--tokens): ms per call (median of --repeats, CUDA events), TFLOP/s of the GEMM,
the first call's seconds (quack compiles at run time), and the largest |diff| of each path against
an fp32 reference on the first --check-rows rows (SiLU(x Wg^T) * (x Wu^T) in fp32). quack runs
untuned (one default tile config: its autotuner keys on the exact shape, so a serving path could
not tune every chunk length) and, with --tuned, autotuned too. For scale, the plain GEMMs of the
other projections on cuBLAS and on quack (qkv, o, down, the LM head) at the largest token count.

    PYTHONPATH=/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:. python3 ops/bench/gpu_gated_mlp_check.py --out $OUT/gated_mlp.json
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from ops.bench.gpu_attention_check import check_parser, deadline_sections, finish_run, median_ms, synced_seconds

HIDDEN, INTERMEDIATE, QKV, VOCAB = 4096, 12288, 6144, 151936
TOKENS = (2048, 8192, 16384, 32768)


def tflops(m: int, k: int, n: int, ms: float) -> float:
    return round(2 * m * k * n / ms / 1e9, 1)


def gated_rows(tokens: int, weight: torch.Tensor, repeats: int, check_rows: int, tuned: bool) -> dict:
    from quack.gemm_interface import gemm_gated_out

    from services.scheduler.model.triton_fused import silu_mul_triton

    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen)
    out = torch.empty(tokens, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)

    def served() -> torch.Tensor:
        return silu_mul_triton(F.linear(x, weight))

    def quack(autotune: bool = False):
        def call() -> torch.Tensor:
            gemm_gated_out(x, weight.T, None, out, activation="swiglu", tuned=autotune, concat_layout="B")
            return out

        return call

    rows = check_rows
    ref = x[:rows].float() @ weight.float().T
    ref = F.silu(ref[:, :INTERMEDIATE]) * ref[:, INTERMEDIATE:]
    row: dict = {"tokens": tokens}
    paths = {"served": served, "quack": quack(False)} | ({"quack_tuned": quack(True)} if tuned else {})
    for name, fn in paths.items():
        first_s = synced_seconds(fn)
        diff = (fn()[:rows].float() - ref).abs().max().item()
        ms = median_ms(fn, "cuda", repeats)
        row[name] = {"ms": ms, "tflops": tflops(tokens, HIDDEN, 2 * INTERMEDIATE, ms), "first_s": first_s, "max_abs_diff": round(diff, 5)}
    row["quack_vs_served"] = round(row["quack"]["ms"] / row["served"]["ms"], 3)
    row["served_vs_quack_identical"] = bool(torch.equal(served(), quack(False)()))
    return row


def new_lengths(weight: torch.Tensor) -> list[dict]:
    """After the shapes above: the first call's seconds at token counts not seen yet (a recompile per
    length would cost seconds in the first prompt of each length)."""
    from quack.gemm_interface import gemm_gated_out

    rows = []
    for tokens in (3000, 16385, 20001, 2049):
        x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
        out = torch.empty(tokens, INTERMEDIATE, device="cuda", dtype=torch.bfloat16)

        def call() -> None:
            gemm_gated_out(x, weight.T, None, out, activation="swiglu", tuned=False, concat_layout="B")

        rows.append({"tokens": tokens, "first_s": synced_seconds(call), "second_s": synced_seconds(call)})
    return rows


def plain_gemms(tokens: int, repeats: int) -> dict:
    """cuBLAS (F.linear) against quack's plain GEMM, untuned, for the other projections."""
    from quack.gemm_interface import gemm_out

    gen = torch.Generator(device="cuda").manual_seed(1)
    shapes = {"qkv": (HIDDEN, QKV), "o": (HIDDEN, HIDDEN), "down": (INTERMEDIATE, HIDDEN), "lm_head_4096": (HIDDEN, VOCAB)}
    rows = {}
    for name, (k, n) in shapes.items():
        m = 4096 if name.startswith("lm_head") else tokens
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=gen) * k**-0.5
        out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        cublas_ms = median_ms(lambda: F.linear(x, w), "cuda", repeats)
        first_s = synced_seconds(lambda: gemm_out(x, w.T, out, tuned=False))
        quack_ms = median_ms(lambda: gemm_out(x, w.T, out, tuned=False), "cuda", repeats)
        same = bool(torch.equal(F.linear(x, w), out))
        rows[name] = {"m": m, "k": k, "n": n, "cublas_ms": cublas_ms, "quack_ms": quack_ms, "cublas_tflops": tflops(m, k, n, cublas_ms),
                      "quack_tflops": tflops(m, k, n, quack_ms), "quack_first_s": first_s, "identical": same}  # fmt: skip
    return rows


def run(args) -> dict:
    if args.device != "cuda":
        raise SystemExit("gpu_gated_mlp_check needs CUDA: quack's kernels have no CPU path")
    deadline = time.monotonic() + args.budget_s
    result: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": list(args.tokens)}
    section = deadline_sections(result, deadline)
    start = time.perf_counter()
    section("import_s", lambda: (__import__("quack.gemm_interface"), round(time.perf_counter() - start, 1))[1])
    gen = torch.Generator(device="cuda").manual_seed(0)
    weight = torch.randn(2 * INTERMEDIATE, HIDDEN, device="cuda", dtype=torch.bfloat16, generator=gen) * HIDDEN**-0.5
    for tokens in args.tokens:
        section(f"gated_{tokens}", lambda t=tokens: gated_rows(t, weight, args.repeats, args.check_rows, args.tuned))
    section("new_lengths", lambda: new_lengths(weight))
    section("plain", lambda: plain_gemms(max(args.tokens), args.repeats))
    return finish_run(result, args, deadline, table)


def table(result: dict) -> str:
    lines = ["| tokens | served ms (GEMM + SiLU x up) | quack gated ms | quack/served | quack tuned ms | max diff served / quack |", "|---|---|---|---|---|---|"]
    for tokens in result["tokens"]:
        row = result.get(f"gated_{tokens}") or {}
        if "served" not in row:
            lines.append(f"| {tokens} | {str(row)[:200]} |")
            continue
        tuned = row.get("quack_tuned", {}).get("ms", "")
        lines.append(f"| {tokens} | {row['served']['ms']} | {row['quack']['ms']} | {row['quack_vs_served']} | {tuned} | "
                     f"{row['served']['max_abs_diff']} / {row['quack']['max_abs_diff']} |")  # fmt: skip
    lines.append(f"new lengths (first, second call s): {result.get('new_lengths')}")
    plain = result.get("plain") or {}
    for name, row in plain.items() if isinstance(plain, dict) and "error" not in plain else ():
        lines.append(f"| plain {name} M={row['m']} | cuBLAS {row['cublas_ms']} | quack {row['quack_ms']} | {row['quack_tflops']} TFLOP/s |")
    if "error" in plain:
        lines.append(plain["error"][-600:])
    return "\n".join(lines)


def main() -> None:
    parser = check_parser(__doc__, tiny="(no CPU run: quack needs CUDA)", repeats=10, budget_s=240, out="gpu_gated_mlp.json")
    parser.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
    parser.add_argument("--check-rows", type=int, default=1024)
    parser.add_argument("--tuned", action="store_true", help="also quack's autotuned GEMM (tunes each shape once)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
