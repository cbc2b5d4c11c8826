"""DSpark through the whole stack on the bundled trained pair: greedy text, stops and logprobs are
the same with speculative decoding as without (PRODUCT §7), and meta_info reports the verify passes.

Two stacks on the same target, one with `--speculative-algorithm dspark`. The trained drafter
accepts ~2.4 tokens per verify, so stop strings and stop ids land inside accepted blocks; the
detokenizer must cut exactly where plain decoding stops.
"""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from e2e.stack import Stack, plain_and_dspark_stacks

pytestmark = pytest.mark.timeout(240)

PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def __init__(self):"]


@pytest.fixture(scope="module")
def stacks(tmp_path_factory) -> Iterator[tuple[Stack, Stack]]:
    yield from plain_and_dspark_stacks(tmp_path_factory)


def _generate(stack: Stack, text: str, **extra) -> dict:
    body = {"text": text, "sampling_params": {"max_new_tokens": 40, "temperature": 0, **extra.pop("sampling", {})},
            "return_logprob": True, "top_logprobs_num": 3, **extra}  # fmt: skip
    response = httpx.post(f"{stack.base_url}/generate", json=body, timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.parametrize("prompt", PROMPTS)
def test_dspark_greedy_text_and_logprobs_equal_plain(stacks, prompt):
    plain, spec = (_generate(s, prompt) for s in stacks)
    assert spec["output_ids"] == plain["output_ids"] and spec["text"] == plain["text"]
    meta, reference = spec["meta_info"], plain["meta_info"]
    assert meta["completion_tokens"] == len(meta["output_token_logprobs"]) == reference["completion_tokens"]
    for got, want in zip(meta["output_token_logprobs"], reference["output_token_logprobs"], strict=True):
        assert got[1] == want[1] and abs(got[0] - want[0]) < 1e-4
    for got, want in zip(meta["output_top_logprobs"], reference["output_top_logprobs"], strict=True):
        assert [e[1] for e in got] == [e[1] for e in want]
    assert meta["spec_verify_ct"] >= 1 and meta["spec_accept_length"] > 1.0
    assert "spec_verify_ct" not in reference


@pytest.mark.parametrize("prompt", PROMPTS[:2])
def test_stop_strings_and_ids_inside_accepted_blocks_stop_where_plain_stops(stacks, prompt):
    free = _generate(stacks[0], prompt)
    text, ids = free["text"], free["output_ids"]
    stop_text = text[len(text) // 2 : len(text) // 2 + 3] or text
    stop_id = ids[len(ids) // 2]
    for extra in ({"sampling": {"stop": [stop_text]}}, {"sampling": {"stop_token_ids": [stop_id]}}):
        plain, spec = (_generate(s, prompt, **{k: dict(v) for k, v in extra.items()}) for s in stacks)
        assert spec["text"] == plain["text"] and spec["output_ids"] == plain["output_ids"], extra
        assert spec["meta_info"]["finish_reason"] == plain["meta_info"]["finish_reason"], extra
        assert len(spec["meta_info"]["output_token_logprobs"]) == spec["meta_info"]["completion_tokens"]
