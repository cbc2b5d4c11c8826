"""`sparkwire push-weights --nats-url URL DIR_OR_SAFETENSORS`: push a checkpoint to every live scheduler."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from contracts.weights import WeightTarget
from services.common.connection import add_connection_arguments, connection_from_args
from services.common.settings import connection_values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a directory of *.safetensors, or one .safetensors file")
    # the schedulers' NATS server; on a secured one, `--nats-user trainer` (its password from SPARKWIRE_NATS_PASSWORD)
    add_connection_arguments(parser, connection_values())
    parser.add_argument("--weight-version", default=None, help="tags every answer from the new weights (default: a counter)")
    parser.add_argument("--target", choices=("model", "draft"), default="model", help="the target model or the DSpark drafter")
    parser.add_argument("--abort-all-requests", action="store_true", help="end requests in flight instead of letting them finish")
    parser.add_argument("--connections", type=int, default=None, metavar="N",
                        help="NATS connections the pieces are striped over (default: sized from the CPU count)")  # fmt: skip


def load_checkpoint(path: Path) -> dict:
    from safetensors.torch import load_file

    files = [path] if path.is_file() else sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    return {name: tensor for file in files for name, tensor in load_file(str(file)).items()}


async def _push(args: argparse.Namespace) -> int:
    from services.weights.push import PushFailed, WeightPusher

    tensors = load_checkpoint(Path(args.path))
    target = WeightTarget.DRAFT if args.target == "draft" else WeightTarget.MODEL
    async with await WeightPusher.connect(connection_from_args(args, connection_values()), args.connections) as pusher:
        try:
            replies = await pusher.push(tensors, args.weight_version, target=target, abort_all_requests=args.abort_all_requests)
        except PushFailed as exc:
            print(f"sparkwire push-weights: {exc}", file=sys.stderr)
            return 1
    print(json.dumps({sid: {"weight_version": r.weight_version, "seconds": round(r.seconds, 3)} for sid, r in replies.items()}))
    return 0


def main(args: argparse.Namespace) -> int:
    from services.common.lifecycle import run_event_loop

    return run_event_loop(_push(args))  # uvloop: it writes a piece's parts with one writev, no join
