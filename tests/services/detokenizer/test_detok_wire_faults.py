"""Nothing from the wire is fatal to the detokenizer: hostile registrations and token batches are
dropped at the decoder, and other users' streams go on."""

from __future__ import annotations

import msgspec
import nats.errors
import numpy as np
import pytest

from contracts import subjects
from contracts.detokenizer import DetokenizeParams, DetokenizerRegistration, Finish, FinishType
from contracts.tokenizer import TextBatch
from services.detokenizer.core import DetokenizerCore
from tests.services.detokenizer.conftest import token_batch
from tests.services.detokenizer.test_detok_service import DETOK_ID, Inbox, register, running_detokenizer


async def raw_registration(client, rid: str, tokenizer_id: str) -> None:
    """A registration as an attacker would send it: past our own encoder's checks."""
    payload = msgspec.msgpack.encode({"rid": rid, "tokenizer_id": tokenizer_id, "params": {}})
    with pytest.raises(nats.errors.TimeoutError):  # dropped at the decoder: nobody answers
        await client._nc.request(subjects.DETOKENIZER_REGISTER, payload, timeout=0.5)


@pytest.mark.timeout(30)
async def test_a_registration_with_a_space_in_its_tokenizer_id_does_not_hang_other_users(
    nats_server, tokenizer, tokenizer_path
):
    async with running_detokenizer(nats_server.url, tokenizer_path) as (client, _beats):
        outputs = Inbox()
        await client.subscribe(subjects.tokenizer_outputs("tok-B"), TextBatch, outputs.handler)
        await client.flush()
        await raw_registration(client, "evil", "tok A")
        await register(client, "good", "tok-B")
        batch = token_batch([("evil", [40], None), ("good", [41, 42], None)])
        await client.publish(subjects.detokenizer_tokens(DETOK_ID), batch)
        text_batch = await outputs.get()
        assert text_batch.rids == ["good"] and text_batch.detokenizer_id == DETOK_ID


@pytest.mark.timeout(30)
async def test_a_token_batch_whose_columns_disagree_is_dropped(nats_server, tokenizer, tokenizer_path):
    async with running_detokenizer(nats_server.url, tokenizer_path) as (client, _beats):
        outputs = Inbox()
        await client.subscribe(subjects.tokenizer_outputs("tok-B"), TextBatch, outputs.handler)
        await client.flush()
        await register(client, "good", "tok-B")
        hostile = msgspec.msgpack.decode(msgspec.msgpack.encode(token_batch([("good", [41, 42], None)])))
        hostile["new_token_ids"] = ["<i4", [1], np.array([41], dtype="<i4").tobytes()]  # counts say 2
        await client._nc.publish(subjects.detokenizer_tokens(DETOK_ID), msgspec.msgpack.encode(hostile))
        await client.publish(subjects.detokenizer_tokens(DETOK_ID), token_batch([("good", [41, 42], None)]))
        text_batch = await outputs.get()
        assert text_batch.rids == ["good"] and len(text_batch.new_token_ids.data) == 2 * 4


def test_a_gap_fails_the_schedulers_requests_and_those_it_had_not_started(tokenizer):
    core = DetokenizerCore(tokenizer, "detok-1")
    for rid, owner in (("a", "tok-A"), ("b", "tok-B"), ("c", "tok-A"), ("other", "tok-A")):
        core.register(DetokenizerRegistration(rid=rid, tokenizer_id=owner, params=DetokenizeParams()))
    core.process(token_batch([("a", [40], None), ("b", [41], None)], scheduler_id="sched-1"))
    core.process(token_batch([("other", [42], None)], scheduler_id="sched-2"))
    after_gap = token_batch([("a", [43], None), ("c", [44], None)], scheduler_id="sched-1")
    result = core.fail(core.rids_from("sched-1", after_gap), "lost")
    assert sorted(abort.rid for abort in result.aborts) == ["a", "b", "c"]
    assert {owner: batch.rids for owner, batch in result.outputs.items()} == {"tok-A": ["a", "c"], "tok-B": ["b"]}
    assert all(f == Finish(FinishType.ABORT, message="lost") for batch in result.outputs.values() for f in batch.finish)
    assert core.held_rids == ["other"] and core.process(after_gap).outputs == {}
