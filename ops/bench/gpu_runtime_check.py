"""Check the model runtime on real shapes: dummy weights, prefill + decode in three modes, timings.

For each model directory: load with load_format dummy, capture the decode CUDA graphs, then at
each batch size prefill `--prefill-len` tokens per sequence in one ragged forward and run one
decode step in each mode from the same state (eager ragged SDPA = the reference, eager Triton
paged-decode kernel, CUDA-graph replay), checking logits shape, finiteness and agreement with
the reference; then time `--decode-steps` greedy steps per mode. The roofline floor is the bytes a
decode step must read (every weight but the embedding table's unused rows) over the
device-to-device copy bandwidth measured in the same run. Writes JSON and a markdown table.

    python ops/bench/gpu_runtime_check.py --out ops/bench/results/gpu_runtime.json   # CUDA bf16
    python ops/bench/gpu_runtime_check.py --device cpu --configs ops/models/sparkwire-tiny
"""

from __future__ import annotations

import argparse
import gc
import json
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CONFIGS = [REPO / "ops/model_configs" / name for name in ("Qwen3-0.6B", "Qwen3-1.7B", "Qwen3-8B")]
DEFAULT_OUT = REPO / "ops/bench/results/gpu_runtime_check.json"
BLOCK_SIZE = 16
MODES = ("eager_sdpa", "eager_kernel", "graph")


@dataclass
class BatchResult:
    batch_size: int
    prefill_ms: float
    prefill_tok_s: float
    decode_ms: dict[str, float]  # mode -> ms per step (forward + logits + argmax)
    decode_tok_s: float  # fastest mode
    logits_max_abs_diff: dict[str, float]  # mode -> vs eager_sdpa on one decode step
    argmax_agree: dict[str, float]  # mode -> fraction of rows whose argmax matches eager_sdpa
    kernels_per_step: int | None = None  # device kernels of one eager-kernel decode step (profiler)


@dataclass
class ConfigResult:
    config: str
    device: str
    dtype: str
    load_s: float = 0.0
    graph_capture_s: float = 0.0
    weight_gb_per_step: float = 0.0
    roofline_ms: float = 0.0
    batches: list[BatchResult] = field(default_factory=list)
    error: str | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth_gb_s(device: torch.device) -> float:
    """Device-to-device copy rate, bytes read plus written, median of 10 (0 on CPU: not measured)."""
    if device.type != "cuda":
        return 0.0
    src = torch.randn(1 << 29, device=device, dtype=torch.bfloat16)  # 1 GiB, well past L2
    dst = torch.empty_like(src)
    times = []
    for _ in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    median_ms = sorted(times[3:])[5]
    return 2 * src.numel() * src.element_size() / median_ms / 1e6


def step_bytes(runner: ModelRunner) -> int:
    """Weight bytes one decode step reads: all parameters, the input embedding only if it is the lm_head."""
    total = sum(p.numel() * p.element_size() for p in runner.model.parameters())
    if not runner.config.tie_word_embeddings:
        embed = runner.model.model.embed_tokens.weight
        total -= embed.numel() * embed.element_size()
    return total


def prefill_batch(runner: ModelRunner, batch_size: int, prefill_len: int, blocks_per_seq: int) -> ForwardBatch:
    device = runner.device
    ids = torch.randint(0, runner.config.vocab_size, (batch_size * prefill_len,), device=device)
    positions = torch.arange(prefill_len, device=device).repeat(batch_size)  # [B * P]
    seq = torch.arange(batch_size, device=device).repeat_interleave(prefill_len)  # [B * P]
    return _batch(runner, ids, positions, seq, batch_size, prefill_len, blocks_per_seq)


def decode_batch(runner: ModelRunner, tokens: torch.Tensor, position: int, blocks_per_seq: int) -> ForwardBatch:
    batch_size = tokens.shape[0]
    positions = torch.full((batch_size,), position, device=runner.device)
    seq = torch.arange(batch_size, device=runner.device)
    return _batch(runner, tokens, positions, seq, batch_size, 1, blocks_per_seq)


def _batch(
    runner: ModelRunner, ids: torch.Tensor, positions: torch.Tensor, seq: torch.Tensor,
    batch_size: int, query_len: int, blocks_per_seq: int,
) -> ForwardBatch:
    # Sequence b owns blocks b * blocks_per_seq ... (b + 1) * blocks_per_seq - 1.
    device = runner.device
    tables = torch.arange(batch_size * blocks_per_seq, device=device, dtype=torch.int32).view(batch_size, -1)
    slots = (seq * blocks_per_seq + positions // BLOCK_SIZE) * BLOCK_SIZE + positions % BLOCK_SIZE
    return ForwardBatch(
        input_ids=ids,
        positions=positions,
        query_start_loc=torch.arange(batch_size + 1, device=device, dtype=torch.int32) * query_len,
        seq_lens=(positions.view(batch_size, query_len)[:, -1] + 1).to(torch.int32),
        block_tables=tables,
        slot_mapping=slots,
    )


def check_logits(logits: torch.Tensor, rows: int, vocab: int) -> None:
    if logits.shape != (rows, vocab):
        raise AssertionError(f"logits shape {tuple(logits.shape)}, expected {(rows, vocab)}")
    if not bool(torch.isfinite(logits).all()):
        raise AssertionError("non-finite logits")


def set_mode(runner: ModelRunner, mode: str, graphs: object, kernel: bool) -> bool:
    """Switch the runner's decode path; False when the mode is unavailable here (no CUDA / Triton)."""
    runner.decode_graphs = graphs if mode == "graph" else None
    runner.decode_kernel = kernel and mode != "eager_sdpa"
    return mode == "eager_sdpa" or (mode == "eager_kernel" and kernel) or (mode == "graph" and graphs is not None)


def decode_logits(runner: ModelRunner, tokens: torch.Tensor, position: int, blocks_per_seq: int) -> torch.Tensor:
    hidden = runner.forward(decode_batch(runner, tokens, position, blocks_per_seq)).hidden_states
    return runner.compute_logits(hidden)  # [B, V]


def compare_modes(
    runner: ModelRunner, tokens: torch.Tensor, position: int, blocks_per_seq: int, modes: list[str], state: tuple
) -> tuple[dict[str, float], dict[str, float]]:
    """One decode step per mode from the same cache state; each mode rewrites the same slots."""
    results = {}
    for mode in modes:
        set_mode(runner, mode, *state)
        logits = decode_logits(runner, tokens, position, blocks_per_seq)
        check_logits(logits, tokens.shape[0], runner.config.vocab_size)
        results[mode] = logits
    ref = results["eager_sdpa"]
    diffs = {m: round(float((lg - ref).abs().max()), 5) for m, lg in results.items() if m != "eager_sdpa"}
    agree = {m: round(float((lg.argmax(-1) == ref.argmax(-1)).float().mean()), 4) for m, lg in results.items()
             if m != "eager_sdpa"}
    return diffs, agree


def count_kernels(runner: ModelRunner, tokens: torch.Tensor, position: int, blocks_per_seq: int) -> int | None:
    """Device kernels (and memsets/copies) one decode step launches, from the profiler; None off CUDA."""
    if runner.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            decode_logits(runner, tokens, position, blocks_per_seq)
            synchronize(runner.device)
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    except Exception:  # the profiler is a diagnostic: never fail the check over it
        traceback.print_exc()
        return None


def time_decode(
    runner: ModelRunner, tokens: torch.Tensor, first_position: int, steps: int, blocks_per_seq: int
) -> float:
    decode_logits(runner, tokens, first_position, blocks_per_seq)  # warm-up for this batch shape
    synchronize(runner.device)
    start = time.perf_counter()
    for step in range(steps):
        tokens = decode_logits(runner, tokens, first_position + step, blocks_per_seq).argmax(-1)  # [B]
    synchronize(runner.device)
    return (time.perf_counter() - start) * 1000 / max(steps, 1)


def run_batch(runner: ModelRunner, batch_size: int, args: argparse.Namespace, state: tuple) -> BatchResult:
    device, vocab, prefill_len = runner.device, runner.config.vocab_size, args.prefill_len
    blocks_per_seq = -(-(prefill_len + args.decode_steps + 2) // BLOCK_SIZE)
    set_mode(runner, "eager_sdpa", *state)
    batch = prefill_batch(runner, batch_size, prefill_len, blocks_per_seq)
    synchronize(device)
    start = time.perf_counter()
    hidden = runner.forward(batch).hidden_states  # [B * P, H]
    logits = runner.compute_logits(hidden.view(batch_size, prefill_len, -1)[:, -1])  # [B, V]
    synchronize(device)
    prefill_s = time.perf_counter() - start
    check_logits(logits, batch_size, vocab)
    tokens = logits.argmax(-1)  # [B]
    modes = [m for m in MODES if set_mode(runner, m, *state)]
    diffs, agree = compare_modes(runner, tokens, prefill_len, blocks_per_seq, modes, state)
    kernels = None
    if "eager_kernel" in modes:
        set_mode(runner, "eager_kernel", *state)
        kernels = count_kernels(runner, tokens, prefill_len, blocks_per_seq)
    decode_ms = {}
    for mode in modes:
        set_mode(runner, mode, *state)
        decode_ms[mode] = round(time_decode(runner, tokens, prefill_len + 1, args.decode_steps, blocks_per_seq), 3)
    set_mode(runner, "graph", *state)
    return BatchResult(
        batch_size=batch_size,
        prefill_ms=round(prefill_s * 1000, 3),
        prefill_tok_s=round(batch_size * prefill_len / prefill_s, 1),
        decode_ms=decode_ms,
        decode_tok_s=round(batch_size * 1000 / min(decode_ms.values()), 1),
        logits_max_abs_diff=diffs,
        argmax_agree=agree,
        kernels_per_step=kernels,
    )


def run_config(path: Path, args: argparse.Namespace, dtype: torch.dtype, bandwidth: float) -> ConfigResult:
    result = ConfigResult(config=str(path), device=args.device, dtype=str(dtype).removeprefix("torch."))
    runner = None
    try:
        blocks = max(args.batch_sizes) * -(-(args.prefill_len + args.decode_steps + 2) // BLOCK_SIZE)
        synchronize(torch.device(args.device))
        start = time.perf_counter()
        runner = load_model_runner(
            path, device=args.device, dtype=dtype, load_format="dummy", num_kv_blocks=blocks,
            kv_block_size=BLOCK_SIZE, cuda_graphs=False,
        )
        synchronize(runner.device)
        result.load_s = round(time.perf_counter() - start, 3)
        result.weight_gb_per_step = round(step_bytes(runner) / 1e9, 3)
        result.roofline_ms = round(step_bytes(runner) / bandwidth / 1e6, 3) if bandwidth else 0.0
        kernel = runner.decode_kernel
        start = time.perf_counter()
        if runner.device.type == "cuda" and not args.no_graphs:
            runner.prepare_decode_graphs(max_blocks_per_seq=args.graph_max_blocks)
        result.graph_capture_s = round(time.perf_counter() - start, 3)
        state = (runner.decode_graphs, kernel)
        for batch_size in args.batch_sizes:
            result.batches.append(run_batch(runner, batch_size, args, state))
    except Exception as exc:  # one bad config must not hide the others' numbers
        traceback.print_exc()
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        del runner
        free_memory(args.device)
    return result


def free_memory(device: str) -> None:
    gc.collect()
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


def kernel_check(device: torch.device) -> float | None:
    """Max |Triton - torch twin| on bf16 ragged paged decode (GQA 32/8, D 128); None off CUDA."""
    if device.type != "cuda":
        return None
    from services.scheduler.model.attention import paged_decode_attention_torch
    from services.scheduler.model.triton_decode import paged_block_attention_triton

    gen = torch.Generator(device=device).manual_seed(0)
    caches = [torch.randn(1024, 16, 8, 128, device=device, generator=gen).bfloat16() for _ in range(2)]
    seq_lens = torch.tensor([1, 15, 16, 17, 333, 1000, 64, 2], dtype=torch.int32, device=device)
    tables = torch.randperm(1024, device=device, generator=gen)[:8 * 63].view(8, 63).to(torch.int32)
    q = torch.randn(8, 32, 128, device=device, generator=gen).bfloat16()
    got = paged_block_attention_triton(q, *caches, seq_lens, tables, 128**-0.5)
    want = paged_decode_attention_torch(q, *caches, seq_lens, tables, 128**-0.5)
    return float((got.float() - want.float()).abs().max())


def markdown_table(results: list[ConfigResult], bandwidth: float, kernel_err: float | None) -> str:
    lines = [
        f"D2D copy bandwidth (read + write): {bandwidth:.0f} GB/s; "
        f"Triton kernel vs torch twin max abs err: {kernel_err}",
        "",
        "| config | load s | capture s | batch | prefill ms | decode ms/step sdpa / kernel / graph | roofline ms"
        " | decode tok/s | graph-vs-eager max abs / argmax agree | kernels/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = Path(r.config).name
        if r.error:
            lines.append(f"| {name} | error: {r.error[:100]} | | | | | | | | |")
        for b in r.batches:
            ms = " / ".join(str(b.decode_ms.get(m, "-")) for m in MODES)
            check = f"{b.logits_max_abs_diff.get('graph', '-')} / {b.argmax_agree.get('graph', '-')}"
            lines.append(
                f"| {name} | {r.load_s} | {r.graph_capture_s} | {b.batch_size} | {b.prefill_ms} | {ms} | "
                f"{r.roofline_ms} | {b.decode_tok_s} | {check} | {b.kernels_per_step} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", type=Path, default=DEFAULT_CONFIGS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 5, 64])
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=32)
    parser.add_argument("--graph-max-blocks", type=int, default=None, help="default: max_position_embeddings / 16")
    parser.add_argument("--no-graphs", action="store_true")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON path; the table goes beside it as .md")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    dtype_name = args.dtype or ("bfloat16" if device.type == "cuda" else "float32")
    torch.manual_seed(0)
    bandwidth = copy_bandwidth_gb_s(device)
    try:
        kernel_err = kernel_check(device)
    except Exception:  # the per-model numbers still come; the table says the check broke
        traceback.print_exc()
        kernel_err = None
    results = [run_config(path, args, getattr(torch, dtype_name), bandwidth) for path in args.configs]
    table = markdown_table(results, bandwidth, kernel_err)
    report = {"copy_bandwidth_gb_s": round(bandwidth, 1), "kernel_max_abs_err": kernel_err,
              "configs": [asdict(r) for r in results]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    args.out.with_suffix(".md").write_text(table + "\n", encoding="utf-8")
    print(f"\nwrote {args.out} and {args.out.with_suffix('.md')}\n")
    print(table)
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
