"""`sparkwire bench serve`: an online serving benchmark against a running server.

Requests arrive at a request rate (Poisson, or gamma with a burstiness) or all at once, optionally
capped at a maximum concurrency; each is streamed, and the client times its first token, every
later token and its end (`ops.bench.serve_metrics` defines the figures). The server is any that
speaks `/generate` (Sparkwire, SGLang) or `/v1/completions` (OpenAI-compatible: a peer), at
`--base-url`; with `--launch` the benchmark starts a `sparkwire up` of its own for the run.

In-process use (the GPU scripts): `run_serve_benchmark(ServeConfig(...))` returns the results
dict that the CLI writes as JSON; `benchmark(config)` is the same inside a running event loop.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import shlex
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from ops.bench.common import RESULTS, script
from ops.bench.serve_client import ENDPOINTS, RequestOptions, RequestRecord, client_session, send
from ops.bench.serve_launch import launched_stack
from ops.bench.serve_metrics import per_request, summarize, table
from ops.bench.serve_workload import Prompt, arrival_offsets, jsonl_prompts, random_prompts, shared_prefix_prompts, token_pool

DATASETS = ("random", "generated-shared-prefix")
from services.models import BUNDLED_MODEL


@dataclass(frozen=True)
class ServeConfig:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "generate"  # a key of serve_client.ENDPOINTS
    num_prompts: int = 100
    input_len: int = 128  # random prompts: token ids per prompt (mean, with range_ratio)
    output_len: int = 128  # max tokens asked per request (exact with ignore_eos)
    range_ratio: float = 0.0  # lengths uniform in [len * (1 - r), len * (1 + r)]
    dataset_path: Path | None = None  # a JSONL file of prompts instead of random ones
    dataset: str = "random"  # random, or generated-shared-prefix: groups sharing a long system prompt (SGLang's)
    gsp_num_groups: int = 64
    gsp_prompts_per_group: int = 16  # so num_prompts is num_groups x this, whatever --num-prompts says
    gsp_system_prompt_len: int = 2048
    gsp_question_len: int = 128
    vocab_from: Path = BUNDLED_MODEL  # a model directory whose tokenizer's ids random prompts use
    request_rate: float = math.inf  # requests per second; inf: all at once
    burstiness: float = 1.0  # gamma shape of the arrival intervals; 1: Poisson
    max_concurrency: int | None = None  # at most this many requests in flight
    ignore_eos: bool = False
    temperature: float = 0.0
    logprobs: int | None = None  # top-k logprobs per output token; None: none asked
    prompt_logprobs: bool = False  # /generate: logprobs (top-k as `logprobs`) of every prompt position too
    model_name: str | None = None  # OpenAI `model`; None: the first of GET /v1/models
    num_warmups: int = 0  # requests sent (and waited for) before the timed run, not counted
    seed: int = 0
    request_timeout_s: float = 600.0
    api_key: str | None = None
    progress: bool = True
    launch: tuple[str, ...] | None = None  # `sparkwire up` flags: start a stack for this run
    launch_log: Path | None = None

    def __post_init__(self) -> None:
        checks = {
            "endpoint": self.endpoint in ENDPOINTS,
            "num_prompts": self.num_prompts >= 1,
            "input_len": self.input_len >= 1,
            "output_len": self.output_len >= 1,
            "range_ratio": 0.0 <= self.range_ratio < 1.0,
            "request_rate": self.request_rate > 0,
            "burstiness": self.burstiness > 0,
            "max_concurrency": self.max_concurrency is None or self.max_concurrency >= 1,
            "logprobs": self.logprobs is None or self.logprobs >= 0,
            # OpenAI's way (echo) streams the prompt back as if generated; /generate keeps them apart.
            "prompt_logprobs": not self.prompt_logprobs or (self.endpoint == "generate" and self.logprobs is not None),
            "num_warmups": self.num_warmups >= 0,
            "dataset": self.dataset in DATASETS,
            "gsp": min(self.gsp_num_groups, self.gsp_prompts_per_group, self.gsp_system_prompt_len, self.gsp_question_len) >= 1,
        }
        if bad := [name for name, ok in checks.items() if not ok]:
            raise ValueError(f"invalid serve benchmark settings: {bad} ({self})")

    def prompts(self) -> list[Prompt]:
        if self.dataset_path is not None:
            return jsonl_prompts(self.dataset_path, self.num_prompts, self.output_len)
        pool = token_pool(self.vocab_from)
        if self.dataset == "generated-shared-prefix":
            return shared_prefix_prompts(self.gsp_num_groups, self.gsp_prompts_per_group, self.gsp_system_prompt_len,
                                         self.gsp_question_len, self.output_len, pool, self.seed)  # fmt: skip
        return random_prompts(self.num_prompts, self.input_len, self.output_len, self.range_ratio, pool, self.seed)

    def as_json(self) -> dict[str, Any]:
        """The settings as the results file records them (no secret, no infinity)."""
        settings = {name: _json_value(value) for name, value in dataclasses.asdict(self).items()}
        return {**settings, "api_key": None if self.api_key is None else "(set)"}


def _json_value(value: Any) -> Any:
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, Path):
        return str(value)
    return value


def run_serve_benchmark(config: ServeConfig) -> dict[str, Any]:
    """The whole run, launching (and stopping) a stack first if the config says so."""
    if config.launch is None:
        return uvloop.run(benchmark(config))
    log_path = config.launch_log or Path(tempfile.mkdtemp(prefix="sparkwire-bench-")) / "up.log"
    with launched_stack(config.launch, config.base_url, log_path) as stack:
        results = uvloop.run(benchmark(config))
    launched = {"up_args": list(config.launch), "ready_s": stack.ready_s, "exit_code": stack.exit_code, "log": str(log_path)}
    return {**results, "launched": launched}


async def benchmark(config: ServeConfig) -> dict[str, Any]:
    prompts = config.prompts()
    async with client_session(config.api_key, config.request_timeout_s) as client:
        model_name = await _model_name(client, config)
        options = RequestOptions(config.ignore_eos, config.temperature, config.logprobs, config.prompt_logprobs, model_name)
        if config.num_warmups:
            warm = _warmup_prompts(config, prompts)
            await _timed_run(client, dataclasses.replace(config, request_rate=math.inf, progress=False), options, warm)
        cpu_start, began = time.process_time(), time.monotonic()
        records, duration_s = await _timed_run(client, config, options, prompts)
        client_cpu_s = time.process_time() - cpu_start
    # A client near 1.0 CPU fraction is the bottleneck: its timestamps lag the server's events.
    client = {"client_cpu_s": client_cpu_s, "client_cpu_fraction": client_cpu_s / duration_s,
              "monotonic_window": [began, time.monotonic()]}  # the timed run on time.monotonic(): a step trace's clock
    return {"config": config.as_json(), **summarize(records, duration_s), **client, "requests": per_request(records)}


def _warmup_prompts(config: ServeConfig, prompts: list[Prompt]) -> list[Prompt]:
    """Generated workloads warm up on prompts of their own (another seed): a server's prefix cache
    would otherwise hold the timed run's prompts before it starts. A dataset file's repeat it."""
    if config.dataset_path is None:
        return dataclasses.replace(config, seed=config.seed + 1, num_prompts=config.num_warmups).prompts()[: config.num_warmups]
    return [prompts[i % len(prompts)] for i in range(config.num_warmups)]


async def _model_name(client: aiohttp.ClientSession, config: ServeConfig) -> str | None:
    if config.model_name is not None or config.endpoint != "completions":
        return config.model_name
    try:
        async with client.get(config.base_url.rstrip("/") + "/v1/models") as response:
            models = (await response.json(content_type=None))["data"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError, KeyError, TypeError):
        return None  # servers that do not list models accept requests without one
    return models[0]["id"] if models else None


async def _timed_run(
    client: aiohttp.ClientSession, config: ServeConfig, options: RequestOptions, prompts: Sequence[Prompt]
) -> tuple[list[RequestRecord], float]:
    """Every prompt sent at its arrival offset (waiting for a concurrency slot after that)."""
    endpoint, bar = ENDPOINTS[config.endpoint], progress_bar(len(prompts), config.progress)
    offsets = arrival_offsets(len(prompts), config.request_rate, config.burstiness, config.seed)
    slots = asyncio.Semaphore(config.max_concurrency or len(prompts))
    start = time.perf_counter()

    async def arrive(prompt: Prompt, offset: float) -> RequestRecord:
        await asyncio.sleep(max(0.0, start + offset - time.perf_counter()))
        async with slots:
            record = await send(client, config.base_url, endpoint, prompt, options)
        bar.update(1)
        return record

    records = await asyncio.gather(*(arrive(p, float(o)) for p, o in zip(prompts, offsets, strict=True)))
    duration_s = time.perf_counter() - start
    bar.close()
    return list(records), duration_s


class TextProgress:
    """A progress line on stderr for machines without tqdm."""

    WIDTH = 30

    def __init__(self, total: int) -> None:
        self.total, self.done = total, 0

    def update(self, count: int) -> None:
        self.done += count
        filled = self.WIDTH * self.done // self.total
        print(f"\r[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} requests", end="", file=sys.stderr)

    def close(self) -> None:
        print(file=sys.stderr)


class NoProgress:
    def update(self, count: int) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, enabled: bool) -> Any:
    """tqdm where it is installed (it comes with the test extras), else a plain line."""
    if not enabled:
        return NoProgress()
    try:
        from tqdm import tqdm
    except ImportError:
        return TextProgress(total)
    return tqdm(total=total, unit="req", desc="bench serve", file=sys.stderr)


def run(config: ServeConfig, out: Path) -> dict[str, Any]:
    """Run, write the JSON to `out`, print the table; the results dict is returned as written."""
    results = run_serve_benchmark(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2) + "\n")
    print(table(results))
    for error in results["errors"]:
        print(f"failed: {error}", file=sys.stderr)
    print(f"results: {out}")
    return results


def add_arguments(serve: argparse.ArgumentParser) -> None:
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
    load.add_argument("--dataset", choices=DATASETS, default="random",
                      help="generated-shared-prefix: --gsp-num-groups system prompts of --gsp-system-prompt-len ids, each "
                           "with --gsp-prompts-per-group questions of --gsp-question-len ids (SGLang's; --num-prompts ignored)")
    load.add_argument("--gsp-num-groups", type=int, default=64)
    load.add_argument("--gsp-prompts-per-group", type=int, default=16)
    load.add_argument("--gsp-system-prompt-len", type=int, default=2048)
    load.add_argument("--gsp-question-len", type=int, default=128)
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


def main(args: argparse.Namespace) -> int:
    names = ("base_url", "endpoint", "model_name", "api_key", "num_prompts", "input_len", "output_len", "range_ratio",
             "dataset_path", "request_rate", "burstiness", "max_concurrency", "ignore_eos", "temperature", "logprobs",
             "prompt_logprobs", "num_warmups", "seed", "request_timeout_s", "dataset", "gsp_num_groups",
             "gsp_prompts_per_group", "gsp_system_prompt_len", "gsp_question_len")  # fmt: skip
    settings = {name: getattr(args, name) for name in names}
    if args.vocab_from is not None:
        settings["vocab_from"] = args.vocab_from
    launch = tuple(shlex.split(args.up_args)) if args.launch else None
    config = ServeConfig(**settings, progress=not args.no_progress, launch=launch, launch_log=args.up_log)
    results = run(config, args.out)
    return 0 if results["failed"] == 0 else 1  # a failed request fails the command (scripts, CI)


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
