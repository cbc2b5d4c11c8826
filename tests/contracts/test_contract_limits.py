"""Every field that arrives over NATS is checked by the decoder: hostile messages fail to decode."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest

from contracts.control import Heartbeat
from contracts.detokenizer import DetokenizerRegistration, TokenBatch
from contracts.logprobs import LogprobColumns
from contracts.limits import MAX_STOP_STRINGS, MAX_TOKEN_IDS_LOGPROB
from contracts.scheduler import AbortRequest, GenerateRequest, SchedulerClaimReply
from contracts.tokenizer import TextBatch


def i32(*values: int) -> list:
    """An NDArray in its wire form (array-like: dtype, shape, bytes)."""
    return ["<i4", [len(values)], np.array(values, dtype="<i4").tobytes()]


def f32(*shape: int) -> list:
    return ["<f4", list(shape), np.zeros(shape, dtype="<f4").tobytes()]


GOOD_BATCH = {"scheduler_id": "s-1", "step": 3, "rids": ["a", "b"], "num_new_tokens": i32(1, 2),
              "new_token_ids": i32(5, 6, 7), "prompt_tokens": i32(4, 4), "finish": [None, None]}  # fmt: skip
GOOD_GENERATE = {"rid": "r", "input_ids": i32(1, 2, 3), "detokenizer_id": "d-1"}

HOSTILE = [
    (GenerateRequest, GOOD_GENERATE | {"detokenizer_id": "d 1"}),
    (GenerateRequest, GOOD_GENERATE | {"detokenizer_id": "d.>"}),
    (GenerateRequest, GOOD_GENERATE | {"detokenizer_id": "d" * 65}),
    (GenerateRequest, GOOD_GENERATE | {"rid": ""}),
    (GenerateRequest, GOOD_GENERATE | {"rid": "r" * 513}),
    (GenerateRequest, GOOD_GENERATE | {"input_ids": ["<f4", [1], b"\0\0\0\0"]}),
    (GenerateRequest, GOOD_GENERATE | {"input_ids": ["<i4", [2], b"\0\0\0\0"]}),  # shape says 8 bytes
    (GenerateRequest, GOOD_GENERATE | {"input_ids": ["<i4", [0], b""]}),
    (GenerateRequest, GOOD_GENERATE | {"input_ids": [">i4", [1], b"\0\0\0\0"]}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"max_new_tokens": 2**40}}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"max_new_tokens": -1}}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"top_k": -2}}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"temperature": float("nan")}}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"top_p": 1.5}}),
    (GenerateRequest, GOOD_GENERATE | {"sampling": {"stop_token_ids": [-1]}}),
    (GenerateRequest, GOOD_GENERATE | {"logprobs": {"token_ids_logprob": [1] * (MAX_TOKEN_IDS_LOGPROB + 1)}}),
    (GenerateRequest, GOOD_GENERATE | {"logprobs": {"logprob_start_len": -2}}),
    (DetokenizerRegistration, {"rid": "r", "tokenizer_id": "tok A", "params": {}}),
    (DetokenizerRegistration, {"rid": "r", "tokenizer_id": "t", "params": {"stop": ["x"] * (MAX_STOP_STRINGS + 1)}}),
    (DetokenizerRegistration, {"rid": "r", "tokenizer_id": "t", "params": {"stop": [""]}}),
    (SchedulerClaimReply, {"scheduler_id": "s*"}),
    (Heartbeat, {"service": "scheduler", "instance_id": "a b"}),
    (Heartbeat, {"service": "scheduler", "instance_id": "a", "num_running": -1}),
    (AbortRequest, {"rid": "r", "reason": "x" * 65}),
    (TokenBatch, GOOD_BATCH | {"scheduler_id": "s.1"}),
    (TokenBatch, GOOD_BATCH | {"rids": ["a"]}),
    (TokenBatch, GOOD_BATCH | {"finish": [None]}),
    (TokenBatch, GOOD_BATCH | {"new_token_ids": i32(5, 6)}),
    (TokenBatch, GOOD_BATCH | {"num_new_tokens": i32(4, -1)}),
    (TokenBatch, GOOD_BATCH | {"finish": [None, [7]]}),  # no such FinishType
    (TokenBatch, GOOD_BATCH | {"output_logprobs": {"rows": i32(0, 3), "token": f32(3)}}),  # 2 new tokens, 3 rows
    (TokenBatch, GOOD_BATCH | {"output_logprobs": {"rows": i32(0, 2), "token": f32(2), "top_k": i32(0, 3),
                                                   "top_values": f32(6), "top_ids": i32(1, 2)}}),  # 6 values, 2 ids
    (TokenBatch, GOOD_BATCH | {"prompt_logprobs": {"rows": i32(2), "token": f32(2)}}),  # one request's columns, two requests
    (TextBatch, GOOD_BATCH | {"detokenizer_id": "d", "text_deltas": ["x"]}),
    (LogprobColumns, {"rows": i32(2), "top_values": f32(4)}),  # values without their widths
]


@pytest.mark.parametrize(("message_type", "fields"), HOSTILE)
def test_hostile_messages_fail_to_decode(message_type, fields):
    decoder = msgspec.msgpack.Decoder(message_type)
    with pytest.raises(msgspec.ValidationError):
        decoder.decode(msgspec.msgpack.encode(fields))


@pytest.mark.parametrize(("message_type", "fields"), [(TokenBatch, GOOD_BATCH), (GenerateRequest, GOOD_GENERATE),
                                                      (TextBatch, GOOD_BATCH | {"detokenizer_id": "d", "text_deltas": ["x", "y"]})])  # fmt: skip
def test_the_good_messages_the_hostile_ones_start_from_decode(message_type, fields):
    assert isinstance(msgspec.msgpack.decode(msgspec.msgpack.encode(fields), type=message_type), message_type)
