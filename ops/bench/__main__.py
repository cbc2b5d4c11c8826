"""`sparkwire bench <name>`: the benchmarks. Each writes a JSON file and prints a short table."""

from __future__ import annotations

import argparse
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="BENCHMARK")
    transport = sub.add_parser(
        "logprob-transport",
        help="prompt top logprobs: flat arrays vs nested rows, per hop, two hops over NATS, response building",
    )
    transport.add_argument("--out", type=Path, default=RESULTS / "logprob_transport.json")
    transport.add_argument("--repeat", type=int, default=9, help="timed repetitions per figure (median)")
    transport.set_defaults(bench=_logprob_transport)


def _logprob_transport(args: argparse.Namespace) -> int:
    from ops.bench.logprob_transport import run

    run(args.out, repeat=args.repeat)
    return 0


def main(args: argparse.Namespace) -> int:
    return args.bench(args)
