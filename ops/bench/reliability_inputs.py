"""The hostile inputs `sparkwire bench reliability` sends: HTTP bodies and NATS messages.

HTTP: hand-made bodies that each must get a 4xx with an error body (bad types, values past every
documented limit, malformed JSON, a body over the size limit, nesting 100k deep, non-JSON media
types). NATS: garbage and hostile-but-well-formed messages on every subject a service reads
(ids that are not subject tokens, columns that disagree, malformed framing, an absurd chunk
count), published past our own encoder by the service identity allowed to publish there: what
a compromised or buggy service could send.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec
import numpy as np

from contracts import subjects
from contracts.limits import MAX_CLIENT_RID_CHARS, MAX_STOP_STRINGS, MAX_TOKEN_IDS_LOGPROB
from services.common.framing import ACK_HEADER, CHUNK_HEADER, MSG_HEADER
from services.tokenizer.validation import MAX_BODY_BYTES, MAX_SEQUENCES_PER_CALL

HUGE = 2**64
CHAT = [{"role": "user", "content": "x"}]
JSON = {"content-type": "application/json"}


@dataclass(frozen=True)
class HttpCase:
    name: str
    path: str
    body: bytes
    headers: dict[str, str]


def _json(name: str, path: str, body: object) -> HttpCase:
    return HttpCase(name, path, msgspec.json.encode(body), JSON)


def _sampling(name: str, **fields: object) -> HttpCase:
    return _json(name, "/generate", {"text": "hi", "sampling_params": fields})


def http_cases() -> list[HttpCase]:
    typed = [
        _json("text is a number", "/generate", {"text": 3}),
        _json("no prompt", "/generate", {}),
        _json("text and input_ids", "/generate", {"text": "a", "input_ids": [1]}),
        _json("out-of-vocab id", "/generate", {"input_ids": [1, 2, 10**9]}),
        _json("negative id", "/generate", {"input_ids": [-1]}),
        _json("ids nested twice", "/generate", {"input_ids": [[[1]]]}),
        _json("prompt past max_model_len", "/generate", {"input_ids": [5] * 40000}),
        _json("streamed batch", "/generate", {"text": ["a", "b"], "stream": True}),
        _sampling("temperature as text", temperature="hot"),
        _sampling("negative temperature", temperature=-1),
        _sampling("top_p 0", top_p=0),
        _sampling("top_k 0", top_k=0),
        _sampling("max_new_tokens past uint64", max_new_tokens=HUGE),
        _sampling("max_new_tokens past int32", max_new_tokens=2**31),
        _sampling("top_k past uint64", top_k=HUGE),
        _sampling("seed past uint64", seed=HUGE),
        _sampling("seed below int64", seed=-(2**63) - 1),
        _sampling("a 2 KB stop string", stop="x" * 2000),
        _sampling("too many stop strings", stop=["x"] * (MAX_STOP_STRINGS + 1)),
        _sampling("empty stop string", stop=[""]),
        _sampling("1000 stop ids", stop_token_ids=[1] * 1000),
        _json("rid too long", "/generate", {"text": "hi", "rid": "r" * (MAX_CLIENT_RID_CHARS + 1)}),
        _json("empty rid", "/generate", {"text": "hi", "rid": ""}),
        _json("rids for a batch mismatch", "/generate", {"text": ["a", "b"], "rid": ["x"]}),
        _json("too many token_ids_logprob", "/generate",
              {"text": "hi", "return_logprob": True, "token_ids_logprob": [1] * (MAX_TOKEN_IDS_LOGPROB + 1)}),
        _json("top_logprobs_num 10^6", "/generate", {"text": "hi", "return_logprob": True, "top_logprobs_num": 10**6}),
        _json("batch past the fan-out cap", "/generate", {"text": ["hi"] * (MAX_SEQUENCES_PER_CALL + 1)}),
        _json("4 MB of text", "/generate", {"text": "a " * 2_000_000}),
        _json("completions: max_tokens past uint64", "/v1/completions", {"prompt": "hi", "max_tokens": HUGE}),
        _json("completions: 20 prompts x n=64", "/v1/completions", {"prompt": ["a"] * 20, "n": 64}),
        _json("completions: logprobs 21", "/v1/completions", {"prompt": "hi", "logprobs": 21}),
        _json("completions: n 0", "/v1/completions", {"prompt": "hi", "n": 0}),
        _json("chat: no messages", "/v1/chat/completions", {"messages": []}),
        _json("chat: max_completion_tokens past uint64", "/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": HUGE}),
        _json("chat: message without role", "/v1/chat/completions", {"messages": [{"content": "x"}]}),
        _json("detokenize: a string id", "/detokenize", {"tokens": ["a"]}),
        _json("tokenize: no prompt", "/tokenize", {}),
    ]  # fmt: skip
    raw = [
        HttpCase("malformed JSON", "/generate", b'{"text": ', JSON),
        HttpCase("empty body", "/generate", b"", JSON),
        HttpCase("a JSON array", "/generate", b"[1, 2]", JSON),
        HttpCase("invalid UTF-8", "/generate", b'{"text": "\xff\xfe"}', JSON),
        HttpCase("nested 100k deep", "/generate", b'{"rid": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),
        HttpCase("nested 100k deep, ignored field", "/generate", b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", JSON),
        HttpCase("max_new_tokens as a string", "/generate", b'{"text": "hi", "sampling_params": {"max_new_tokens": "10"}}', JSON),
        HttpCase("n as a float", "/v1/completions", b'{"prompt": "hi", "n": 1.0}', JSON),
        HttpCase("body over the limit", "/generate", b'{"text": "' + b"a" * MAX_BODY_BYTES + b'"}', JSON),
        HttpCase("text/plain body", "/generate", b'{"text": "hi"}', {"content-type": "text/plain"}),
        HttpCase("form body", "/v1/completions", b"prompt=hi", {"content-type": "application/x-www-form-urlencoded"}),
    ]
    return typed + raw


@dataclass(frozen=True)
class NatsMessage:
    sender: str  # the service kind whose NATS identity may publish on `subject`
    name: str
    subject: str
    payload: bytes
    headers: dict[str, str] | None = None
    request: bool = False  # sent as a request (queue-group subjects); nobody should answer it


def _i32(*values: int) -> list[object]:
    return ["<i4", [len(values)], np.array(values, dtype="<i4").tobytes()]


def nats_messages(scheduler_id: str, detokenizer_id: str, tokenizer_id: str) -> list[NatsMessage]:
    generate = subjects.scheduler_generate(scheduler_id)
    tokens = subjects.detokenizer_tokens(detokenizer_id)
    outputs = subjects.tokenizer_outputs(tokenizer_id)
    batch = {"scheduler_id": scheduler_id, "step": 1, "rids": ["ghost"], "num_new_tokens": _i32(2),
             "new_token_ids": _i32(5, 6), "prompt_tokens": _i32(3), "finish": [None]}  # fmt: skip
    encode = msgspec.msgpack.encode
    messages = [
        NatsMessage("tokenizer", "generate: detokenizer_id with a space", generate,
                    encode({"rid": "evil", "input_ids": _i32(1, 2), "detokenizer_id": "a b"})),
        NatsMessage("tokenizer", "generate: input_ids of the wrong size", generate,
                    encode({"rid": "evil", "input_ids": ["<i4", [9], b"\0" * 4], "detokenizer_id": detokenizer_id})),
        NatsMessage("tokenizer", "generate: max_new_tokens 2^40", generate,
                    encode({"rid": "evil", "input_ids": _i32(1), "detokenizer_id": detokenizer_id,
                            "sampling": {"max_new_tokens": 2**40}})),
        NatsMessage("tokenizer", "register: tokenizer_id with a space", subjects.DETOKENIZER_REGISTER,
                    encode({"rid": "evil", "tokenizer_id": "t x", "params": {}}), request=True),
        NatsMessage("tokenizer", "claim: negative prompt length", subjects.SCHEDULER_CLAIM,
                    encode({"rid": "evil", "num_prompt_tokens": -5}), request=True),
        NatsMessage("scheduler", "tokens: columns disagree", tokens, encode(batch | {"new_token_ids": _i32(5)})),
        NatsMessage("scheduler", "tokens: scheduler id with a dot", tokens, encode(batch | {"scheduler_id": "a.b"})),
        NatsMessage("scheduler", "tokens: unknown rid", tokens, encode(batch)),
        NatsMessage("detokenizer", "outputs: text deltas missing", outputs,
                    encode(batch | {"detokenizer_id": detokenizer_id, "text_deltas": []})),
        NatsMessage("tokenizer", "abort: 4 KB reason", subjects.SCHEDULER_ABORT, encode({"rid": "x", "reason": "y" * 4096})),
        NatsMessage("scheduler", "heartbeat: instance id with a space", subjects.heartbeat("scheduler"),
                    encode({"service": "scheduler", "instance_id": "a b"})),
    ]  # fmt: skip
    senders = {generate: "tokenizer", tokens: "scheduler", outputs: "detokenizer", subjects.SCHEDULER_ABORT: "tokenizer",
               subjects.heartbeat("detokenizer"): "detokenizer"}  # fmt: skip
    for subject, sender in senders.items():
        messages.append(NatsMessage(sender, f"garbage bytes on {subject}", subject, b"\xc1\xff\x00garbage"))
        messages += _bad_framing(sender, subject)
    return messages


def _bad_framing(sender: str, subject: str) -> list[NatsMessage]:
    chunk = b"\x01" * (64 * 1024)
    framings = {
        "Sw-Chunk abc": {MSG_HEADER: "m-1", CHUNK_HEADER: "abc"},
        "Sw-Chunk missing": {MSG_HEADER: "m-1"},
        "chunk 5 of 3": {MSG_HEADER: "m-1", CHUNK_HEADER: "5/3"},
        "15,000 chunks announced": {MSG_HEADER: "m-2", CHUNK_HEADER: "0/15000"},
        "ack to the abort subject": {MSG_HEADER: "m-3", CHUNK_HEADER: "0/2", ACK_HEADER: subjects.SCHEDULER_ABORT},
    }
    return [NatsMessage(sender, f"{name} on {subject}", subject, chunk, headers) for name, headers in framings.items()]
