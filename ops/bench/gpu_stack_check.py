"""Smoke-run the whole stack on a GPU: `sparkwire up --device cuda` on the bundled model, then
HTTP traffic through all three services (batch of 64 concurrent requests, logprobs, streaming,
the OpenAI endpoint), checking every answer and timing the batch. Prints a short table.

    PATH=/tmp/site/bin:$PATH PYTHONPATH=/tmp/site:. python3 ops/bench/gpu_stack_check.py --out $OUT/gpu_stack.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

PORT = 8000


def start_up(log_path: Path, device: str) -> subprocess.Popen[bytes]:
    command = [sys.executable, "-m", "services.cli", "up", "--device", device, "--port", str(PORT)]
    return subprocess.Popen(command, stdout=log_path.open("wb"), stderr=subprocess.STDOUT)


async def wait_ready(client: httpx.AsyncClient, process: subprocess.Popen[bytes], timeout_s: float = 300) -> float:
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if process.poll() is not None:
            raise RuntimeError(f"sparkwire up exited with {process.returncode}")
        try:
            if (await client.get("/health")).status_code == 200:
                return time.monotonic() - start
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.5)
    raise TimeoutError("not healthy")


def body(index: int, new_tokens: int, logprobs: bool) -> dict:
    extra = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5} if logprobs else {}
    text = f"def function_{index}(a, b):\n    return"
    return {"text": text, "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}, **extra}


async def batch(client: httpx.AsyncClient, size: int, new_tokens: int, logprobs: bool) -> dict:
    start = time.perf_counter()
    responses = await asyncio.gather(*(client.post("/generate", json=body(i, new_tokens, logprobs)) for i in range(size)))
    wall = time.perf_counter() - start
    results = [r.json() for r in responses]
    assert all(r.status_code == 200 for r in responses), [r.text[:200] for r in responses if r.status_code != 200]
    assert all(r["meta_info"]["completion_tokens"] == new_tokens for r in results)
    if logprobs:
        assert all(len(r["meta_info"]["output_token_logprobs"]) == new_tokens for r in results)
        meta = results[0]["meta_info"]
        assert len(meta["input_token_logprobs"]) == meta["prompt_tokens"]
    return {"batch": size, "logprobs": logprobs, "wall_s": wall, "tok_s": size * new_tokens / wall,
            "outputs": [r["output_ids"] for r in results]}


async def checks(client: httpx.AsyncClient) -> dict:
    greedy = [await client.post("/generate", json=body(0, 16, False)) for _ in range(2)]
    same = greedy[0].json()["output_ids"] == greedy[1].json()["output_ids"]
    events = []
    async with client.stream("POST", "/generate", json={**body(1, 16, False), "stream": True}) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                events.append(json.loads(line[6:]))
    plain = (await client.post("/generate", json=body(1, 16, False))).json()
    completion = await client.post("/v1/completions", json={"prompt": "def add(a, b):", "max_tokens": 8, "temperature": 0,
                                                             "logprobs": 3, "echo": True})
    return {"greedy_repeatable": same, "stream_equals_plain": events[-1]["text"] == plain["text"],
            "openai_completions_status": completion.status_code,
            "openai_logprob_tokens": len(completion.json()["choices"][0]["logprobs"]["tokens"])}


async def run(out: Path, device: str) -> None:
    process = start_up(out.parent / "up.log", device)
    try:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{PORT}", timeout=300) as client:
            ready_s = await wait_ready(client, process)
            await batch(client, 4, 8, False)  # warm-up
            rows = [await batch(client, size, 64, lp) for size in (1, 64) for lp in (False, True)]
            same_batch = rows[2]["outputs"] == (await batch(client, 64, 64, False))["outputs"]  # rows[2]: 64, no logprobs
            result = {"ready_s": ready_s, "rows": [{k: v for k, v in r.items() if k != "outputs"} for r in rows],
                      "batch_repeatable": same_batch, **await checks(client)}
    finally:
        process.send_signal(signal.SIGINT)
        result_code = process.wait(timeout=60)
    result["up_exit_code"] = result_code
    out.write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}))
    print("| batch | logprobs | tok/s | wall s |\n|---|---|---|---|")
    for r in result["rows"]:
        print(f"| {r['batch']} | {r['logprobs']} | {r['tok_s']:.0f} | {r['wall_s']:.2f} |")


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("ops/bench/results/gpu_stack.json"))
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    asyncio.run(run(args.out, args.device))
