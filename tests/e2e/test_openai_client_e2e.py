"""The official `openai` client against the real stack: logprobs in /v1/completions and
/v1/chat/completions, stream and non-stream, equal /generate's and a plain forward pass's.

Token ids never appear in OpenAI responses, so each test sends the same request to /generate
(which returns ids) and maps ids to token texts/bytes straight from `tokenizer.json`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from e2e.reference import TOL, Vocab, check_top, load_reference_runner, post_generate, reference_logprobs
from e2e.stack import Stack
from services.scheduler.model import ModelRunner

# The same prompt asked twice: the second reuses the first's cached prefix, so its tail is computed
# over another split and rounds differently (float32, well inside TOL)
SAME = 1e-5

pytestmark = pytest.mark.timeout(60)

PROMPT = "def héllo(a, b):\n    return ✓ a"  # multi-byte characters exercise text_offset
MAX_TOKENS = 6
GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}
MESSAGES = [{"role": "user", "content": "Say ünïcode ✓ please"}]


@pytest.fixture(scope="module")
def runner() -> ModelRunner:
    return load_reference_runner()


@pytest.fixture(scope="module")
def vocab() -> Vocab:
    return Vocab.load()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.base_url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def oai(stack: Stack) -> Iterator[openai.OpenAI]:
    client = openai.OpenAI(base_url=stack.base_url + "/v1", api_key="x", max_retries=0, timeout=30)
    yield client
    client.close()


@pytest.fixture(scope="module")
def model(oai: openai.OpenAI) -> str:
    return oai.models.list().data[0].id


def label(vocab: Vocab, token_id: int) -> str:
    """A token as OpenAI shows it: its text, or `bytes:\\xNN...` when not valid UTF-8 alone."""
    raw = vocab.token_bytes(token_id)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


def char_offsets(pieces: list[bytes]) -> list[int]:
    """Character offset of each piece's first byte in the joined UTF-8 text; a piece that starts
    inside a multi-byte character gets that character's offset."""
    offsets, seen = [], b""
    for piece in pieces:
        starts = sum((b & 0xC0) != 0x80 for b in seen)  # characters begun so far
        inside = bool(piece) and (piece[0] & 0xC0) == 0x80
        offsets.append(starts - 1 if inside else starts)
        seen += piece
    return offsets


def generate_same(http: httpx.Client, prompt: str | list[int], top: int, start: int) -> dict[str, Any]:
    """The /generate twin of an OpenAI call: same prompt, greedy, same length, logprobs."""
    key = "text" if isinstance(prompt, str) else "input_ids"
    sampling = {"max_new_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    return post_generate(http, {key: prompt, "sampling_params": sampling, "return_logprob": True,
                                "logprob_start_len": start, "top_logprobs_num": top})


# ---- completions ----


def echo_sequence(native: dict[str, Any]) -> tuple[list[int], list[float | None], list[list | None]]:
    """Token ids, values and top rows of prompt (from position 0) then output, from /generate."""
    meta = native["meta_info"]
    entries = meta["input_token_logprobs"] + meta["output_token_logprobs"]
    tops = meta["input_top_logprobs"] + meta["output_top_logprobs"]
    return [i for _, i, _ in entries], [v for v, _, _ in entries], tops


def check_echo_logprobs(logprobs: Any, text: str, native: dict[str, Any], vocab: Vocab, runner: ModelRunner, k: int) -> None:
    ids, values, tops = echo_sequence(native)
    assert logprobs.tokens == [label(vocab, i) for i in ids]
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    for got, want in zip(logprobs.token_logprobs[1:], values[1:], strict=True):
        assert abs(got - want) <= SAME
    for got, want in zip(logprobs.top_logprobs[1:], tops[1:], strict=True):
        assert got == pytest.approx({label(vocab, i): v for v, i, _ in want}, abs=SAME)
    pieces = [vocab.token_bytes(i) for i in ids]
    assert b"".join(pieces).decode("utf-8") == text
    assert logprobs.text_offset == char_offsets(pieces)
    assert all(a <= b for a, b in zip(logprobs.text_offset, logprobs.text_offset[1:]))
    for token, offset in zip(logprobs.tokens, logprobs.text_offset, strict=True):
        if not token.startswith("bytes:"):
            assert text.startswith(token, offset), (token, offset)
    ref = reference_logprobs(runner, ids)  # [n, V]
    for p in range(1, len(ids)):
        assert abs(logprobs.token_logprobs[p] - ref[p - 1, ids[p]].item()) <= TOL, p
        check_top(ref[p - 1], [(v, i) for v, i, _ in tops[p]], k)


def test_completions_echo_logprobs_prompt_first_then_output(oai, model, http, vocab, runner):
    completion = oai.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, echo=True, logprobs=5, **GREEDY)
    choice, usage = completion.choices[0], completion.usage
    native = generate_same(http, PROMPT, 5, 0)
    assert usage.prompt_tokens == native["meta_info"]["prompt_tokens"]
    assert usage.completion_tokens == MAX_TOKENS == native["meta_info"]["completion_tokens"]
    assert choice.text == PROMPT + native["text"]
    assert len(choice.logprobs.tokens) == usage.prompt_tokens + usage.completion_tokens
    lengths = {len(choice.logprobs.token_logprobs), len(choice.logprobs.top_logprobs), len(choice.logprobs.text_offset)}
    assert lengths == {len(choice.logprobs.tokens)}
    check_echo_logprobs(choice.logprobs, choice.text, native, vocab, runner, 5)


def test_completions_stream_with_echo_and_logprobs_equals_non_stream(oai, model):
    kwargs = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "echo": True, "logprobs": 2, **GREEDY}
    full = oai.completions.create(**kwargs).choices[0]
    text, tokens, values, tops, offsets = "", [], [], [], []
    for chunk in oai.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            if choice.logprobs is not None:
                tokens += choice.logprobs.tokens
                values += choice.logprobs.token_logprobs
                tops += choice.logprobs.top_logprobs
                offsets += choice.logprobs.text_offset
    assert text == full.text
    assert tokens == full.logprobs.tokens
    assert offsets == full.logprobs.text_offset  # offsets continue across chunks
    assert values[0] is None and tops[0] is None
    assert values[1:] == pytest.approx(full.logprobs.token_logprobs[1:], abs=SAME)
    for got, want in zip(tops[1:], full.logprobs.top_logprobs[1:], strict=True):
        assert got == pytest.approx(want, abs=SAME)


def test_completions_stream_without_echo_has_output_logprobs_only(oai, model, http, vocab, runner):
    ids = vocab.encode(PROMPT)
    chunks = list(oai.completions.create(model=model, prompt=ids, max_tokens=MAX_TOKENS, logprobs=3, stream=True, **GREEDY))
    tokens = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.tokens]
    values = [v for c in chunks for ch in c.choices if ch.logprobs for v in ch.logprobs.token_logprobs]
    tops = [t for c in chunks for ch in c.choices if ch.logprobs for t in ch.logprobs.top_logprobs]
    native = generate_same(http, ids, 3, -1)
    output = native["output_ids"]
    assert tokens == [label(vocab, i) for i in output] and len(output) == MAX_TOKENS
    ref = reference_logprobs(runner, ids + output)  # [n, V]
    for j, token_id in enumerate(output):
        row = ref[len(ids) + j - 1]
        assert abs(values[j] - row[token_id].item()) <= TOL
        assert set(tops[j]) == {label(vocab, i) for _, i, _ in native["meta_info"]["output_top_logprobs"][j]}
        assert max(tops[j].values()) == pytest.approx(values[j], abs=SAME)  # greedy: the token is the top-1


# ---- chat ----


def check_chat_content(content: list[Any], output: list[int], vocab: Vocab, ref, num_prompt: int, k: int) -> None:
    by_bytes = {raw: i for i, raw in enumerate(vocab.table)}
    assert len(content) == len(output)
    for j, (item, token_id) in enumerate(zip(content, output, strict=True)):
        row = ref[num_prompt + j - 1]  # [V]
        assert bytes(item.bytes) == vocab.token_bytes(token_id) and item.token == label(vocab, token_id)
        if not item.token.startswith("bytes:"):
            assert item.bytes == list(item.token.encode())
        assert abs(item.logprob - row[token_id].item()) <= TOL
        top = [(t.logprob, by_bytes[bytes(t.bytes)]) for t in item.top_logprobs]
        check_top(row, top, k)  # sorted, each value exact, none better left out
        assert top[0][1] == token_id  # greedy


def test_chat_logprobs_and_top_logprobs(oai, model, http, vocab, runner):
    kwargs = {"messages": MESSAGES, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 3, **GREEDY}
    reply = oai.chat.completions.create(model=model, **kwargs)
    ids = vocab.chat_ids(MESSAGES)
    assert reply.usage.prompt_tokens == len(ids)
    native = generate_same(http, ids, 3, -1)
    output = native["output_ids"]
    assert reply.usage.completion_tokens == len(output) == MAX_TOKENS
    content = reply.choices[0].logprobs.content
    assert reply.choices[0].message.content == native["text"]
    assert b"".join(bytes(item.bytes) for item in content).decode("utf-8") == native["text"]
    for item, (value, _, _) in zip(content, native["meta_info"]["output_token_logprobs"], strict=True):
        assert abs(item.logprob - value) <= SAME
    check_chat_content(content, output, vocab, reference_logprobs(runner, ids + output), len(ids), 3)


def test_chat_stream_logprobs_equal_non_stream(oai, model, http, vocab, runner):
    kwargs = {"model": model, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "logprobs": True, "top_logprobs": 3, **GREEDY}
    full = oai.chat.completions.create(**kwargs).choices[0]
    text, content = "", []
    for chunk in oai.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            if choice.logprobs is not None and choice.logprobs.content:
                content += choice.logprobs.content
    assert text == full.message.content
    want = full.logprobs.content
    assert [(c.token, c.bytes) for c in content] == [(c.token, c.bytes) for c in want]
    assert [c.logprob for c in content] == pytest.approx([c.logprob for c in want], abs=SAME)
    for got, expected in zip(content, want, strict=True):
        assert [(t.token, t.bytes) for t in got.top_logprobs] == [(t.token, t.bytes) for t in expected.top_logprobs]
    ids = vocab.chat_ids(MESSAGES)
    output = generate_same(http, ids, 0, -1)["output_ids"]
    check_chat_content(content, output, vocab, reference_logprobs(runner, ids + output), len(ids), 3)


# ---- the matched stop string: trimmed, or kept when asked ----

STOP_PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def free_run(http: httpx.Client) -> str:
    """The bundled model's greedy text for STOP_PROMPT, no stop string."""
    body = {"text": STOP_PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}}
    return post_generate(http, body)["text"]


def first_unique_piece(text: str, size: int = 3) -> tuple[int, str]:
    """A piece of `text` past its first few characters whose first occurrence is where it is taken:
    stopping on it ends the text there."""
    for start in range(4, len(text) - size):
        piece = text[start : start + size]
        if piece.strip() and text.find(piece) == start:
            return start, piece
    raise AssertionError(f"no usable stop string in {text!r}")


def streamed_text(http: httpx.Client, path: str, body: dict[str, Any]) -> tuple[str, str | None]:
    """(text, finish reason) of a streamed OpenAI call, folded from its chunks."""
    text, finish = "", None
    with http.stream("POST", path, json=body | {"stream": True}) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                choice = json.loads(line[6:])["choices"][0]
                text += choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                finish = choice["finish_reason"] or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("keep", [False, True])
def test_completions_keep_the_stop_string_only_when_asked(http, model, free_run, stream, keep):
    start, stop = first_unique_piece(free_run)
    body = {"model": model, "prompt": STOP_PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True,
            "stop": [stop], "include_stop_str_in_output": keep}  # fmt: skip
    if stream:
        text, finish = streamed_text(http, "/v1/completions", body)
    else:
        choice = http.post("/v1/completions", json=body).json()["choices"][0]
        text, finish = choice["text"], choice["finish_reason"]
    assert text == free_run[: start + len(stop)] if keep else free_run[:start]
    assert finish == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_chat_keeps_the_stop_string_when_asked(http, model, stream):
    body = {"model": model, "messages": MESSAGES, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
    start, stop = first_unique_piece(free)
    asked = body | {"stop": [stop], "include_stop_str_in_output": True}
    if stream:
        text, finish = streamed_text(http, "/v1/chat/completions", asked)
    else:
        choice = http.post("/v1/chat/completions", json=asked).json()["choices"][0]
        text, finish = choice["message"]["content"], choice["finish_reason"]
    assert (text, finish) == (free[: start + len(stop)], "stop")


@pytest.mark.parametrize("stream", [False, True])
def test_generate_no_stop_trim_keeps_the_stop_string(http, free_run, stream):
    start, stop = first_unique_piece(free_run)
    sampling = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True, "stop": [stop], "no_stop_trim": True}
    body = {"text": STOP_PROMPT, "sampling_params": sampling, "stream": stream}
    if stream:
        with http.stream("POST", "/generate", json=body) as response:
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
        last = events[-1]
    else:
        last = http.post("/generate", json=body).json()
    assert last["text"] == free_run[: start + len(stop)]
    assert last["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
