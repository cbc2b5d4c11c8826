"""`n` = 3 through the whole stack: /v1/completions and /generate (`sampling_params.n`). The
scheduler forks the choices from one prefill; each must be what a call of its own with the
choice's seed (`choice_seed`) returns, logprobs (prompt ones included) too."""

from __future__ import annotations

import json

import httpx
import pytest

from services.tokenizer.validation import choice_seed

pytestmark = pytest.mark.timeout(120)

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef main():"
SEED = 1234
TOL = 1e-4


def _post(stack, path: str, body: dict) -> dict | list:
    response = httpx.post(f"{stack.base_url}{path}", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


def _num_requests_added(stack) -> int:
    """GenerateRequests the scheduler took (its log line per request)."""
    return stack.services["scheduler"].log_path.read_text(errors="replace").count("scheduler.request_added")


def _close(a, b, where: str) -> None:
    """JSON values equal, floats within TOL (a choice's output rows run in another batch than a call's own)."""
    if isinstance(a, float) and isinstance(b, float):
        assert abs(a - b) <= TOL, where
    elif isinstance(a, dict) and isinstance(b, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            _close(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list) and isinstance(b, list):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _close(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_completions_n3_equal_three_seeded_calls(stack, temperature):
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": temperature, "seed": SEED, "logprobs": 2, "echo": True,
            "ignore_eos": True}  # fmt: skip
    before = _num_requests_added(stack)
    together = _post(stack, "/v1/completions", body | {"n": 3})["choices"]
    assert _num_requests_added(stack) == before + 1  # one request: the scheduler forked the choices
    assert [c["index"] for c in together] == [0, 1, 2]
    for j, choice in enumerate(together):
        alone = _post(stack, "/v1/completions", body | {"seed": choice_seed(SEED, j)})["choices"][0]
        _close({**choice, "index": 0}, alone, f"choice {j}")
        assert choice["logprobs"]["tokens"][0] and choice["text"].startswith(PROMPT)
    if temperature > 0:
        assert len({c["text"] for c in together}) == 3


def _native(text: str, seed: int, **sampling) -> dict:
    return {"text": text, "sampling_params": {"max_new_tokens": 12, "temperature": 1.0, "seed": seed, "ignore_eos": True, **sampling},
            "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 2}  # fmt: skip


def _strip(output: dict) -> dict:
    meta = {k: v for k, v in output["meta_info"].items() if k not in ("id", "e2e_latency")}
    return {"text": output["text"], "output_ids": output["output_ids"], "meta_info": meta}


def test_generate_n3_equals_three_seeded_calls_and_streams_with_index(stack):
    before = _num_requests_added(stack)
    together = _post(stack, "/generate", _native(PROMPT, SEED, n=3))
    assert _num_requests_added(stack) == before + 1
    assert isinstance(together, list) and len(together) == 3
    alone = [_post(stack, "/generate", _native(PROMPT, choice_seed(SEED, j))) for j in range(3)]
    for j in range(3):
        _close(_strip(together[j]), _strip(alone[j]), f"choice {j}")
    assert len({tuple(o["output_ids"]) for o in together}) == 3

    last: dict[int, dict] = {}
    with httpx.stream("POST", f"{stack.base_url}/generate", json=_native(PROMPT, SEED, n=3) | {"stream": True}, timeout=60) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                event = json.loads(line.removeprefix("data:"))
                last[event["index"]] = event
    assert sorted(last) == [0, 1, 2]
    assert [last[j]["output_ids"] for j in range(3)] == [o["output_ids"] for o in alone]
