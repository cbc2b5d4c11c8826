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
    _add_serve(sub)
    _add_reliability(sub)


def _logprob_transport(args: argparse.Namespace) -> int:
    from ops.bench.logprob_transport import run

    run(args.out, repeat=args.repeat)
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="online serving: request rate or concurrency, TTFT / ITL / TPOT / e2e, tok/s",
                           description="Online serving benchmark against a running server (or one --launch starts).")
    target = serve.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000")
    target.add_argument("--endpoint", choices=("generate", "completions"), default="generate",
                        help="generate: /generate (native); completions: /v1/completions (any OpenAI-compatible server)")
    target.add_argument("--model-name", default=None, help="OpenAI `model` (default: the first of GET /v1/models)")
    target.add_argument("--api-key", default=None, help="sent as Authorization: Bearer")
    target.add_argument("--launch", action="store_true", help="start `sparkwire up` on the base URL's port for the run")
    target.add_argument("--up-args", default="", help='flags for the launched `sparkwire up`, e.g. --up-args="--device cuda"')
    target.add_argument("--up-log", type=Path, default=None, help="the launched stack's output (default: a temp file)")
    load = serve.add_argument_group("workload")
    load.add_argument("--num-prompts", type=int, default=100)
    load.add_argument("--input-len", type=int, default=128, help="random prompts: token ids per prompt")
    load.add_argument("--output-len", type=int, default=128, help="tokens asked per request")
    load.add_argument("--range-ratio", type=float, default=0.0, help="lengths uniform in len * [1 - r, 1 + r]")
    load.add_argument("--dataset-path", type=Path, default=None,
                      help='JSONL prompts instead: {"prompt": str} or {"input_ids": [int]}, optional "output_len"')
    load.add_argument("--vocab-from", type=Path, default=None, help="model dir whose tokenizer random ids come from")
    load.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s (default inf: all at once)")
    load.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1 = Poisson")
    load.add_argument("--max-concurrency", type=int, default=None)
    load.add_argument("--ignore-eos", action="store_true", help="generate exactly the asked lengths")
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument("--logprobs", type=int, default=None, help="ask top-k logprobs per output token (measures their cost)")
    load.add_argument("--prompt-logprobs", action="store_true",
                      help="with --logprobs, on /generate: the same top-k for every prompt position too")
    load.add_argument("--num-warmups", type=int, default=0)
    load.add_argument("--seed", type=int, default=0)
    load.add_argument("--request-timeout-s", type=float, default=600.0)
    serve.add_argument("--out", type=Path, default=RESULTS / "serve.json")
    serve.add_argument("--no-progress", action="store_true")
    serve.set_defaults(bench=_serve)


def _serve(args: argparse.Namespace) -> int:
    import shlex

    from ops.bench.serve import ServeConfig, run

    names = ("base_url", "endpoint", "model_name", "api_key", "num_prompts", "input_len", "output_len", "range_ratio",
             "dataset_path", "request_rate", "burstiness", "max_concurrency", "ignore_eos", "temperature", "logprobs",
             "prompt_logprobs", "num_warmups", "seed", "request_timeout_s")  # fmt: skip
    settings = {name: getattr(args, name) for name in names}
    if args.vocab_from is not None:
        settings["vocab_from"] = args.vocab_from
    launch = tuple(shlex.split(args.up_args)) if args.launch else None
    config = ServeConfig(**settings, progress=not args.no_progress, launch=launch, launch_log=args.up_log)
    results = run(config, args.out)
    return 0 if results["failed"] == 0 else 1  # a failed request fails the command (scripts, CI)


def _add_reliability(sub: argparse._SubParsersAction) -> None:
    from ops.bench.reliability import ALL_CASES, ReliabilityConfig

    defaults = ReliabilityConfig()
    reliability = sub.add_parser("reliability", help="hostile HTTP and NATS input, kill -9 of each service and of nats-server, "
                                 "concurrent streams, against a `sparkwire up` of its own; lost/short/5xx must be 0")  # fmt: skip
    reliability.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(ALL_CASES))
    reliability.add_argument("--num-concurrent", type=int, default=defaults.num_concurrent)
    reliability.add_argument("--num-in-flight", type=int, default=defaults.num_in_flight, help="requests running at each fault")
    reliability.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    reliability.add_argument("--fault-tokens", type=int, default=defaults.fault_tokens, help="tokens per request hit by a fault")
    reliability.add_argument("--up-args", default="", help='flags for the launched `sparkwire up`, e.g. --up-args="--device cpu"')
    reliability.add_argument("--up-log", type=Path, default=None)
    reliability.add_argument("--out", type=Path, default=RESULTS / "reliability.json")
    reliability.set_defaults(bench=_reliability)


def _reliability(args: argparse.Namespace) -> int:
    import shlex

    from ops.bench.reliability import ReliabilityConfig, run

    config = ReliabilityConfig(
        cases=tuple(args.cases), num_concurrent=args.num_concurrent, num_in_flight=args.num_in_flight,
        max_new_tokens=args.max_new_tokens, fault_tokens=args.fault_tokens, up_args=tuple(shlex.split(args.up_args)),
        up_log=args.up_log,
    )  # fmt: skip
    return 0 if run(args.out, config)["passed"] else 1


def main(args: argparse.Namespace) -> int:
    return args.bench(args)
