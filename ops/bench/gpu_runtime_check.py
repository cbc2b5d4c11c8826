"""Check the model runtime on real shapes: dummy weights, prefill + decode, timings, finite logits.

For each model directory: load with load_format dummy, then at each batch size prefill
`--prefill-len` tokens per sequence in one ragged forward and run `--decode-steps` greedy decode
steps. Writes a JSON file and prints a markdown table. A failing config is reported and skipped.

    python ops/bench/gpu_runtime_check.py                       # the ops/model_configs shapes, CUDA bf16
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


@dataclass
class BatchResult:
    batch_size: int
    prefill_ms: float
    prefill_tok_s: float
    decode_ms_per_step: float
    decode_tok_s: float


@dataclass
class ConfigResult:
    config: str
    device: str
    dtype: str
    load_s: float = 0.0
    batches: list[BatchResult] = field(default_factory=list)
    error: str | None = None


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


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


def run_batch(runner: ModelRunner, batch_size: int, prefill_len: int, decode_steps: int) -> BatchResult:
    device, vocab = runner.device, runner.config.vocab_size
    blocks_per_seq = -(-(prefill_len + decode_steps) // BLOCK_SIZE)
    batch = prefill_batch(runner, batch_size, prefill_len, blocks_per_seq)
    synchronize(device)
    start = time.perf_counter()
    hidden = runner.forward(batch).hidden_states  # [B * P, H]
    logits = runner.compute_logits(hidden.view(batch_size, prefill_len, -1)[:, -1])  # [B, V]
    synchronize(device)
    prefill_s = time.perf_counter() - start
    check_logits(logits, batch_size, vocab)
    start = time.perf_counter()
    for step in range(decode_steps):
        tokens = logits.argmax(-1)  # [B]
        hidden = runner.forward(decode_batch(runner, tokens, prefill_len + step, blocks_per_seq)).hidden_states
        logits = runner.compute_logits(hidden)
    synchronize(device)
    decode_s = time.perf_counter() - start
    check_logits(logits, batch_size, vocab)
    step_ms = decode_s * 1000 / max(decode_steps, 1)
    return BatchResult(
        batch_size=batch_size,
        prefill_ms=round(prefill_s * 1000, 3),
        prefill_tok_s=round(batch_size * prefill_len / prefill_s, 1),
        decode_ms_per_step=round(step_ms, 3),
        decode_tok_s=round(batch_size * 1000 / step_ms, 1) if step_ms else 0.0,
    )


def run_config(path: Path, args: argparse.Namespace, dtype: torch.dtype) -> ConfigResult:
    result = ConfigResult(config=str(path), device=args.device, dtype=str(dtype).removeprefix("torch."))
    runner = None
    try:
        blocks = max(args.batch_sizes) * -(-(args.prefill_len + args.decode_steps) // BLOCK_SIZE)
        synchronize(torch.device(args.device))
        start = time.perf_counter()
        runner = load_model_runner(
            path, device=args.device, dtype=dtype, load_format="dummy", num_kv_blocks=blocks, kv_block_size=BLOCK_SIZE
        )
        synchronize(runner.device)
        result.load_s = round(time.perf_counter() - start, 3)
        run_batch(runner, 1, 16, 2)  # warm-up: kernel selection and allocator growth
        for batch_size in args.batch_sizes:
            result.batches.append(run_batch(runner, batch_size, args.prefill_len, args.decode_steps))
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


def markdown_table(results: list[ConfigResult]) -> str:
    lines = [
        "| config | dtype | load s | batch | prefill ms | prefill tok/s | decode ms/step | decode tok/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in results:
        name = Path(result.config).name
        if result.error:
            lines.append(f"| {name} | {result.dtype} | error: {result.error[:80]} | | | | | |")
        for b in result.batches:
            lines.append(
                f"| {name} | {result.dtype} | {result.load_s} | {b.batch_size} | {b.prefill_ms} | "
                f"{b.prefill_tok_s} | {b.decode_ms_per_step} | {b.decode_tok_s} |"
            )
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", nargs="+", type=Path, default=DEFAULT_CONFIGS)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                        help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--batch-sizes", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--prefill-len", type=int, default=128)
    parser.add_argument("--decode-steps", type=int, default=16)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype_name = args.dtype or ("bfloat16" if torch.device(args.device).type == "cuda" else "float32")
    torch.manual_seed(0)
    results = [run_config(path, args, getattr(torch, dtype_name)) for path in args.configs]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n", encoding="utf-8")
    print(f"\nwrote {args.out}\n")
    print(markdown_table(results))
    return 1 if any(r.error for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
