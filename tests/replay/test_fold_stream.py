"""`fold_stream`, the replay tests' view of a stream: events merged as a client reads them, so the
grouping of tokens into events (which depends on timing) does not matter and the tokens do."""

from __future__ import annotations

import json
from pathlib import Path

from services.recorder.golden import fold_stream

GOLDEN = json.loads((Path(__file__).resolve().parent / "goldens" / "golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}


def pairwise_merged(events: list, fold_at: int) -> list:
    """The stream as a server that merged events fold_at and fold_at + 1 would have sent it."""
    return [*events[:fold_at], *fold_stream(events[fold_at : fold_at + 2]), *events[fold_at + 2 :]]


def test_every_golden_stream_folds_alike_however_its_events_are_grouped():
    for name in ("stream", "utf8_stream", "completions_stream"):
        events = CASES[name]["response"]
        data_events = sum(isinstance(e, dict) for e in events)
        assert data_events >= 3, name
        for fold_at in range(data_events - 1):
            regrouped = pairwise_merged(events, fold_at)
            assert len(regrouped) == len(events) - 1, (name, fold_at)
            assert fold_stream(regrouped) == fold_stream(events), (name, fold_at)


def test_a_folded_native_stream_is_its_last_event_with_every_entry():
    events = CASES["stream"]["response"]
    (folded, done) = fold_stream(events)
    data = [e for e in events if isinstance(e, dict)]
    assert done == "[DONE]" and folded["output_ids"] == data[-1]["output_ids"] and folded["text"] == data[-1]["text"]
    entries = [entry for e in data for entry in e["meta_info"]["output_token_logprobs"]]
    assert folded["meta_info"]["output_token_logprobs"] == entries and len(entries) == len(folded["output_ids"])


def test_a_changed_token_still_shows_after_folding():
    events = [dict(e) if isinstance(e, dict) else e for e in CASES["completions_stream"]["response"]]
    changed = json.loads(json.dumps(events))
    changed[1]["choices"][0]["text"] += "!"
    assert fold_stream(changed) != fold_stream(events)


def test_chat_chunks_fold_their_content_and_logprobs_but_not_the_role_or_usage():
    def chunk(delta: dict, logprobs: list | None, finish: str | None = None) -> dict:
        return {"id": "c", "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": delta, "logprobs": logprobs and {"content": logprobs}, "finish_reason": finish}]}  # fmt: skip

    usage = {"id": "c", "object": "chat.completion.chunk", "choices": [], "usage": {"completion_tokens": 2}}
    role = chunk({"role": "assistant", "content": ""}, None)
    events = [role, chunk({"content": "a"}, [{"token": "a"}]), chunk({"content": "b"}, [{"token": "b"}], "length"), usage, "[DONE]"]
    folded = fold_stream(events)
    assert folded[0] == role and folded[2:] == [usage, "[DONE]"]
    assert folded[1]["choices"][0]["delta"] == {"content": "ab"} and folded[1]["choices"][0]["finish_reason"] == "length"
    assert folded[1]["choices"][0]["logprobs"] == {"content": [{"token": "a"}, {"token": "b"}]}


def test_errors_and_other_choices_are_never_folded():
    a = {"choices": [{"index": 0, "text": "x", "logprobs": None, "finish_reason": None}]}
    b = {"choices": [{"index": 1, "text": "y", "logprobs": None, "finish_reason": None}]}
    error = {"error": {"message": "gone"}}
    assert fold_stream([a, b, error, "[DONE]"]) == [a, b, error, "[DONE]"]
