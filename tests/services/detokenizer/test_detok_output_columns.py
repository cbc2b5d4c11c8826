"""The detokenizer gives the same `TextBatch` bytes for a `TokenBatch` whose output logprob entries
come per request (`RequestLogprobs`, as old schedulers and the recorded goldens send them) or as the
batch's columns (`OutputLogprobColumns`, as the scheduler sends them now): stop-string cuts and
prompt entries included."""

from __future__ import annotations

from types import SimpleNamespace

import msgspec

from contracts.detokenizer import DetokenizeParams, DetokenizerRegistration, Finish, FinishType, RequestLogprobs
from services.common.arrays import from_wire, to_wire
from services.common.output_logprob_columns import to_columns
from services.detokenizer.core import OUTPUT_LOGPROB_FIELDS, DetokenizerCore
from tests.services.common.test_output_logprob_columns import entries, f32
from tests.services.detokenizer.conftest import token_batch

ENCODE = msgspec.msgpack.Encoder().encode


def columnar(batch):
    """`batch` with its requests' output entries moved into the batch's columns, as the scheduler sends them."""
    held = [None if e is None else SimpleNamespace(**{name: None if getattr(e, name) is None else from_wire(getattr(e, name))
                                                      for name in OUTPUT_LOGPROB_FIELDS}) for e in batch.logprobs]  # fmt: skip
    prompt_only = [None if e is None else msgspec.structs.replace(e, **dict.fromkeys(OUTPUT_LOGPROB_FIELDS)) for e in batch.logprobs]
    # as `wire._beside_columns`: a request whose rows are all it has keeps None
    beside = [None if p == RequestLogprobs() and e.output_token_logprobs is not None else p
              for p, e in zip(prompt_only, batch.logprobs, strict=True)]  # fmt: skip
    return msgspec.structs.replace(batch, logprobs=beside, output_logprobs=to_columns(held))


def test_the_detokenizer_sends_on_the_same_text_batches_for_either_form(tokenizer) -> None:
    # a: top-5 and two ids, stopped by a stop string inside its second step (its rows cut there);
    # b: no logprobs; c: prompt entries with its first output row, then top-1 only.
    ids = tokenizer.encode("hello world, this is a longer text to stop at STOP and more after").ids
    stop_at = next(i for i in range(len(ids)) if "STOP" in tokenizer.decode(ids[: i + 1]))
    prompt = RequestLogprobs(input_start=1, input_token_logprobs=f32(3))
    steps = [(ids[:stop_at - 2], [4, 4], 1), (ids[stop_at - 2 : stop_at + 3], [2, 7], 5)]
    cores = []
    for _ in range(2):
        core = DetokenizerCore(tokenizer, "d")
        for rid, params in (("a", DetokenizeParams(stop=("STOP",))), ("b", DetokenizeParams()), ("c", DetokenizeParams())):
            core.register(DetokenizerRegistration(rid, "tok-1", params))
        cores.append(core)
    for step, (a_ids, c_ids, c_k) in enumerate(steps):
        a_rows = entries(len(a_ids), 5, 2, step)
        c_rows = entries(len(c_ids), c_k, 0, 10 + step)
        logprobs = [RequestLogprobs(**{n: to_wire(v) for n, v in vars(a_rows).items() if v is not None}), None,
                    msgspec.structs.replace(prompt if step == 0 else RequestLogprobs(),
                                            **{n: to_wire(v) for n, v in vars(c_rows).items() if v is not None})]  # fmt: skip
        batch = token_batch([("a", a_ids, None), ("b", [9], None), ("c", c_ids, Finish(FinishType.LENGTH) if step else None)], logprobs, step)
        old, new = (core.process(b) for core, b in zip(cores, (batch, columnar(batch)), strict=True))
        assert old.outputs.keys() == new.outputs.keys() == {"tok-1"} and old.aborts == new.aborts
        assert ENCODE(old.outputs["tok-1"]) == ENCODE(new.outputs["tok-1"])
    assert [a.rid for a in old.aborts] == ["a"]  # the stop string was matched in the last step, and cut there
