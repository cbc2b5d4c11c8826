"""What `sparkwire bench serve`'s client costs: CPU per streamed event, against a server that
does nothing but stream (so the client's share is all there is to see).

A local SSE server (`sse_server`, uvicorn + httptools + uvloop in a process of its own) streams
`--output-len` events per POST /generate, one every `--interval-ms`, each carrying the cumulative
`output_ids` as Sparkwire's /generate does. The client sends `--num-prompts` requests at most
`--concurrency` at a time, as `bench serve --max-concurrency` does, and reports its own CPU seconds
and CPU microseconds per event:

- `aiohttp_uvloop`: `serve_client.send`, on uvloop: what `bench serve` runs;
- `aiohttp_asyncio`: the same on the stock asyncio loop;
- `httpx_asyncio`: the baseline, the httpx streaming client `bench serve` used before.

    python -m ops.bench.serve_client_cost --out ops/bench/results/serve_client_cost.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgspec
import uvloop

from ops.bench.serve_client import ENDPOINTS, RequestOptions, client_session, send
from ops.bench.serve_launch import health_ok
from ops.bench.serve_workload import Prompt
from services.common.nats_server import free_port, stop_process

REPO = Path(__file__).resolve().parents[2]
CLIENTS = ("aiohttp_uvloop", "aiohttp_asyncio", "httpx_asyncio")


async def _with_aiohttp(url: str, prompts: list[Prompt], concurrency: int, logprobs: int | None) -> int:
    from ops.bench.serve import ServeConfig

    slots, endpoint, options = asyncio.Semaphore(concurrency), ENDPOINTS["generate"], RequestOptions(ignore_eos=True, logprobs=logprobs)
    defaults = ServeConfig()
    async with client_session(defaults.api_key, defaults.request_timeout_s) as client:

        async def one(prompt: Prompt) -> int:
            async with slots:
                record = await send(client, url, endpoint, prompt, options)
            assert record.ok, record.error
            return len(record.chunk_times)

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


async def _with_httpx(url: str, prompts: list[Prompt], concurrency: int, logprobs: int | None) -> int:
    """BASELINE: the httpx client `bench serve` used before (streamed lines, JSON per event)."""
    slots, body = asyncio.Semaphore(concurrency), ENDPOINTS["generate"].body
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=600, trust_env=False) as client:

        async def one(prompt: Prompt) -> int:
            events = 0
            async with slots, client.stream("POST", "/generate", json=body(prompt, RequestOptions(ignore_eos=True, logprobs=logprobs))) as response:
                async for line in response.aiter_lines():
                    if line.startswith("data:") and line[5:].strip() != "[DONE]":
                        msgspec.json.decode(line[5:])
                        events += 1
            return events

        return sum(await asyncio.gather(*(one(p) for p in prompts)))


def measure(client: str, url: str, prompts: list[Prompt], concurrency: int, logprobs: int | None = None) -> dict:
    run = uvloop.run if client == "aiohttp_uvloop" else asyncio.run
    reader = _with_httpx if client.startswith("httpx") else _with_aiohttp
    cpu, wall = time.process_time(), time.perf_counter()
    events = run(reader(url, prompts, concurrency, logprobs))
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    return {"client": client, "logprobs": logprobs, "events": events, "wall_s": round(wall, 3), "cpu_s": round(cpu, 3),
            "cpu_fraction": round(cpu / wall, 3), "cpu_us_per_event": round(1e6 * cpu / events, 1)}  # fmt: skip


def run(args: argparse.Namespace) -> dict:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "ops.bench.sse_server", "--port", str(port), "--interval-ms", str(args.interval_ms)],
                              cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while not health_ok(url):
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the SSE server did not come up")
            time.sleep(0.1)
        prompts = [Prompt(tuple(range(args.input_len)), None, args.output_len) for _ in range(args.num_prompts)]
        rows = [measure(client, url, prompts, args.concurrency, logprobs) for _ in range(args.repeats)
                for logprobs in (None, *args.logprobs) for client in CLIENTS]  # fmt: skip
    finally:
        stop_process(server, 10)
    result = {"config": {k: v for k, v in vars(args).items() if k != "out"}, "rows": rows}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    print("| client | top logprobs | events | wall s | CPU s | CPU fraction | CPU us / event |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['client']} | {r['logprobs'] or ''} | {r['events']} | {r['wall_s']} | {r['cpu_s']} | {r['cpu_fraction']} | {r['cpu_us_per_event']} |")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-prompts", type=int, default=192)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--interval-ms", type=float, default=6.0, help="the server's time between a stream's events")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--logprobs", type=int, nargs="*", default=[20], help="also with this many top logprobs a token (none: plain only)")
    parser.add_argument("--out", type=Path, default=None)
    run(parser.parse_args())


if __name__ == "__main__":
    main()
