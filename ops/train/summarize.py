"""One line per training job of `run_gpu.sh`'s work folder: what it trained and how it scored.

    python -m ops.train.summarize /tmp/sparkwire-train
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def summarize(job: Path) -> str:
    parts = [job.name]
    if target := _load(job / "target.json"):
        parts.append(f"target {target['parameters']:,} params {target['train_seconds']}s "
                     f"loss {target['final_train_loss']:.3f}/{target['final_eval_loss']:.3f}")  # fmt: skip
    if drafter := _load(job / "drafter.json"):
        parts.append(f"drafter {drafter['parameters']:,} params {drafter['train_seconds']}s "
                     f"loss {drafter['final_train_loss']:.3f}/{drafter['final_eval_loss']:.3f} "
                     f"tf-accept {drafter['final_eval_teacher_forced_greedy_accept']:.2f}")  # fmt: skip
    if evaluation := _load(job / "eval.json"):
        if held_out := evaluation.get("target", {}).get("held_out"):
            parts.append(f"ppl {held_out['perplexity']:.3f} bpb {held_out['bits_per_byte']:.4f} "
                         f"(shuffled ppl {evaluation['target']['shuffled']['perplexity']:.0f})")  # fmt: skip
        accept = {key: round(value["mean_accept_length"], 3) for key, value in evaluation.get("drafter", {}).items()
                  if key.startswith("temperature")}  # fmt: skip
        if accept:
            parts.append(f"accept {accept}")
    return " | ".join(parts)


def main(argv: list[str] | None = None) -> int:
    work = Path((argv or sys.argv[1:])[0])
    for job in sorted(path for path in work.iterdir() if path.is_dir()):
        print(summarize(job))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
