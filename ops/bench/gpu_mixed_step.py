"""A mixed step — decodes beside a new request's prefill chunk — with the decodes' attention on the
padded SDPA group (before) against the paged kernel's `PagedGroup` (now), in one run.

Under realistic arrivals most steps of a busy server are mixed: every new request's prefill chunk
rides with the running decodes, and such a step cannot replay a decode graph. This times one on
the Qwen3-8B shape with dummy bf16 weights: `--batch` decoding sequences at `--context` tokens,
plus one `--prefill`-token chunk, through `ModelRunner.forward`, attention planned both ways; and,
as references from the same run, the decode step alone (graph replay) and the prefill chunk alone.
It checks that both plans give the same next tokens. CUDA events, median of `--repeats`.

    python ops/bench/gpu_mixed_step.py --out $OUT/gpu_mixed_step.json
    python ops/bench/gpu_mixed_step.py --device cpu --target ops/models/sparkwire-tiny --batch 4 --context 24 --prefill 20
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from services.scheduler.model.batch import ForwardBatch
from services.scheduler.model.loader import load_model_runner
from services.scheduler.model.runner import ModelRunner

REPO = Path(__file__).resolve().parents[2]
BLOCK_SIZE = 16


def ragged_batch(runner: ModelRunner, chunks: list[tuple[int, int, int]], blocks_per_seq: int) -> ForwardBatch:
    """chunks: (sequence, first position, number of new tokens); sequence s owns blocks s * blocks_per_seq ..."""
    device = runner.device
    gen = torch.Generator().manual_seed(len(chunks))
    ids, positions, slots, starts, lens = [], [], [], [0], []
    for seq, start, count in chunks:
        pos = torch.arange(start, start + count)
        ids.append(torch.randint(0, runner.config.vocab_size, (count,), generator=gen))
        positions.append(pos)
        slots.append((seq * blocks_per_seq + pos // BLOCK_SIZE) * BLOCK_SIZE + pos % BLOCK_SIZE)
        starts.append(starts[-1] + count)
        lens.append(start + count)
    seqs = torch.tensor([seq for seq, _, _ in chunks])
    tables = seqs[:, None] * blocks_per_seq + torch.arange(blocks_per_seq)[None, :]
    return ForwardBatch(
        input_ids=torch.cat(ids).to(device),
        positions=torch.cat(positions).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(torch.int32).to(device),
        slot_mapping=torch.cat(slots).to(device),
        host_query_lens=tuple(count for _, _, count in chunks),
        host_seq_lens=tuple(lens),
    )


def median_ms(runner: ModelRunner, batch: ForwardBatch, repeats: int) -> float:
    for _ in range(3):
        runner.forward(batch)
    times = []
    for _ in range(repeats):
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()  # host clock: planning the ragged step is host work, counted
        runner.forward(batch)
        if runner.device.type == "cuda":
            torch.cuda.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return round(statistics.median(times), 3)


def outputs(runner: ModelRunner, batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden states f32 [T, H], next token of each sequence [B])."""
    hidden = runner.forward(batch).hidden_states
    last = torch.tensor(batch.host_query_lens, device=runner.device).cumsum(0) - 1
    return hidden.float(), runner.compute_logits(hidden[last]).argmax(-1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=Path, default=REPO / "ops/model_configs/Qwen3-8B")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--prefill", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    blocks_per_seq = -(-(max(args.context, args.prefill) + 1) // BLOCK_SIZE)
    runner = load_model_runner(
        args.target, device=args.device, dtype=torch.bfloat16 if cuda else torch.float32, load_format="dummy",
        num_kv_blocks=(args.batch + 1) * blocks_per_seq, kv_block_size=BLOCK_SIZE, cuda_graphs=False,
    )  # fmt: skip
    if cuda:
        runner.prepare_decode_graphs(ladder=(args.batch,), max_blocks_per_seq=blocks_per_seq)
    decoders = list(range(args.batch))
    runner.forward(ragged_batch(runner, [(s, 0, args.context - 1) for s in decoders], blocks_per_seq))  # their KV
    decode = [(s, args.context - 1, 1) for s in decoders]
    mixed = ragged_batch(runner, [*decode, (args.batch, 0, args.prefill)], blocks_per_seq)
    if not cuda:  # no kernel: the paged groups run its torch twin, so the CPU smoke test compares both plans
        runner._paged_query_lens = lambda: (1,)
    paged_lens = runner._paged_query_lens
    result = {"target": str(args.target), "device": args.device, "batch": args.batch, "context": args.context,
              "prefill": args.prefill, "paged_query_lens": list(paged_lens())}  # fmt: skip
    result["decode_alone_ms"] = median_ms(runner, ragged_batch(runner, decode, blocks_per_seq), args.repeats)
    result["prefill_alone_ms"] = median_ms(runner, ragged_batch(runner, [(args.batch, 0, args.prefill)], blocks_per_seq), args.repeats)
    result["mixed_paged_ms"] = median_ms(runner, mixed, args.repeats)
    paged_hidden, paged_tokens = outputs(runner, mixed)
    runner._paged_query_lens = lambda: ()  # the padded SDPA group for the decodes: the previous path
    result["mixed_sdpa_ms"] = median_ms(runner, mixed, args.repeats)
    sdpa_hidden, sdpa_tokens = outputs(runner, mixed)
    scale = float(sdpa_hidden.abs().max())
    result["hidden_max_abs_diff_relative"] = round(float((paged_hidden - sdpa_hidden).abs().max()) / scale, 5)
    result["next_token_agreement"] = round(float((paged_tokens == sdpa_tokens).float().mean()), 4)
    result["speedup"] = round(result["mixed_sdpa_ms"] / result["mixed_paged_ms"], 2)
    print(json.dumps(result))
    print(f"| mixed step, {args.batch} decodes @ {args.context} + {args.prefill}-token prefill | "
          f"SDPA group {result['mixed_sdpa_ms']} ms | paged {result['mixed_paged_ms']} ms | {result['speedup']}x | "
          f"decode alone {result['decode_alone_ms']} ms | prefill alone {result['prefill_alone_ms']} ms | "
          f"next tokens agree {result['next_token_agreement']} |")  # fmt: skip
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
