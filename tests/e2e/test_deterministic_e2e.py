"""`sparkwire up --deterministic` as a user runs it (the bundled micro model, CPU): 64 requests with
prompt, chosen, top-5 and requested-id logprobs, sent one by one and then all at once, answer
byte-identical bodies (the latency field aside)."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest

from e2e.test_up import start_up, wait_for_line
from services.common.nats_server import free_port

LATENCY = re.compile(rb'"e2e_latency":[-+0-9.eE]+')
WORDS = ("def", "class", "return", "import", "while", "lambda", "yield", "print", "self", "async")


def body(i: int) -> dict:
    text = " ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(3 + i % 11))
    return {
        "rid": f"det-{i}", "text": text, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 5,
        "token_ids_logprob": [7, 3], "return_flat_raw_top_logprobs": True, "sampling_params": {"max_new_tokens": 6 + i % 5, "temperature": 0, "ignore_eos": True},
    }  # fmt: skip


async def send_all(url: str, bodies: list[dict]) -> list[bytes]:
    async with httpx.AsyncClient(timeout=240) as client:
        responses = await asyncio.gather(*(client.post(url, json=b) for b in bodies))
    assert all(r.status_code == 200 for r in responses), [r.text for r in responses if r.status_code != 200][:2]
    return [r.content for r in responses]


@pytest.mark.timeout(420)
def test_one_by_one_and_all_at_once_answer_byte_identical_bodies(tmp_path):
    port = free_port()
    process, log = start_up(tmp_path, port, "--deterministic", "--device", "cpu", "--chunked-prefill-size", "32")
    try:
        wait_for_line(process, log, f"Sparkwire ready on http://127.0.0.1:{port}", 180)
        url = f"http://127.0.0.1:{port}/generate"
        bodies = [body(i) for i in range(64)]
        with httpx.Client(timeout=60) as client:
            one_by_one = [client.post(url, json=b) for b in bodies]
        assert all(r.status_code == 200 for r in one_by_one), one_by_one[0].text
        at_once = asyncio.run(send_all(url, bodies))
        for i, (alone, together) in enumerate(zip(one_by_one, at_once)):
            assert b'"output_token_logprobs"' in alone.content and b'"output_top_logprobs"' in alone.content
            assert LATENCY.sub(b"", alone.content) == LATENCY.sub(b"", together), i
    finally:
        process.terminate()
        process.wait(timeout=30)
