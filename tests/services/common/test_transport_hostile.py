"""The transport against hostile and unlucky traffic: malformed framing never drops the
connection nor reserves what a header announces, and lost messages are noticed."""

from __future__ import annotations

import asyncio

import msgspec
import pytest

from services.common.framing import ACK_HEADER, CHUNK_HEADER, MSG_HEADER
from services.common.transport import Transport
from tests.services.common.test_transport import SUBJECT, Blob, blob, pair, subscribed_pair

KB = 1024

MALFORMED_CHUNKS = [
    {MSG_HEADER: "m-1", CHUNK_HEADER: "abc"},
    {MSG_HEADER: "m-1"},  # no Sw-Chunk at all
    {MSG_HEADER: "m-1", CHUNK_HEADER: "5/3"},
    {MSG_HEADER: "m-1", CHUNK_HEADER: "-1/3"},
    {MSG_HEADER: "m-1", CHUNK_HEADER: "0/0"},
    {MSG_HEADER: "m-1", CHUNK_HEADER: "1" * 40 + "/" + "2" * 40},
    {MSG_HEADER: "m 1", CHUNK_HEADER: "0/2"},  # not one of our message ids
    {MSG_HEADER: "m-1", CHUNK_HEADER: "0/15000"},  # 15,000 x 64 KiB announced: over max_message_bytes
    {MSG_HEADER: "m-1", CHUNK_HEADER: "0/2", ACK_HEADER: "sparkwire.v1.scheduler.abort"},
]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("headers", MALFORMED_CHUNKS, ids=lambda h: h.get(CHUNK_HEADER, "missing"))
async def test_a_malformed_chunk_is_dropped_without_dropping_the_connection(nats_server, headers):
    sender, receiver, got = await subscribed_pair(nats_server.url)
    await sender._nc.publish(SUBJECT, b"\x01" * (64 * KB), headers=headers)
    await sender.publish(SUBJECT, blob(1, 10))
    await got.wait_for(1, 10)
    assert got.got == [blob(1, 10)]
    assert receiver.events.disconnects == 0
    (state,) = receiver._receivers
    assert state._partial_bytes == sum(s.buffer.nbytes for s in state._partial.values()) <= 2 * 64 * KB
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_reassemblies_in_progress_are_capped_per_subscription(nats_server):
    sender, receiver = await pair(nats_server.url)
    receiver.max_partial_bytes = 3 * 2 * 64 * KB  # room for three of them
    got = []

    async def keep(message: Blob, _delivery) -> None:
        got.append(message)

    await receiver.subscribe(SUBJECT, Blob, keep)
    await receiver.flush()
    for index in range(10):  # ten first chunks of two-chunk messages that never finish
        await sender._nc.publish(SUBJECT, b"\x01" * (64 * KB), headers={MSG_HEADER: f"m-{index}", CHUNK_HEADER: "0/2"})
    await sender.publish(SUBJECT, blob(2, 10))
    async with asyncio.timeout(10):
        while not got:
            await asyncio.sleep(0.02)
    (state,) = receiver._receivers
    assert len(state._partial) == 3 and state._partial_bytes == 3 * 2 * 64 * KB
    assert receiver.events.disconnects == 0
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_a_lost_message_is_reported_on_the_next_one_from_its_sender(nats_server):
    sender, receiver = await pair(nats_server.url)
    deliveries = []

    async def keep(message: Blob, delivery) -> None:
        deliveries.append((message.seq, delivery.missed))

    await receiver.subscribe(SUBJECT, Blob, keep)
    await receiver.flush()
    publish = sender._nc.publish

    async def lose_seq_1_and_2(subject, payload=b"", reply="", headers=None):
        if msgspec.msgpack.decode(bytes(payload), type=Blob).seq not in (1, 2):
            await publish(subject, payload, reply, headers)

    sender._nc.publish = lose_seq_1_and_2  # as if the server had dropped them
    for seq in range(5):
        await sender.publish(SUBJECT, blob(seq, 10))
    async with asyncio.timeout(10):
        while len(deliveries) < 3:
            await asyncio.sleep(0.02)
    assert deliveries == [(0, 0), (3, 2), (4, 0)]
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(60)
async def test_a_reconnect_of_the_receiving_connection_is_reported_as_a_possible_loss(nats_server_factory):
    server = nats_server_factory()
    receiver = await Transport.connect(server.url, "r")
    losses = []
    receiver.on_receive_loss(lambda: losses.append(True))
    await receiver.subscribe(SUBJECT, Blob, lambda _m, _d: asyncio.sleep(0))
    await receiver.flush()
    server.kill()
    nats_server_factory(port=server.port)
    async with asyncio.timeout(30):
        while not losses:
            await asyncio.sleep(0.05)
    assert losses == [True]
    await receiver.close()


@pytest.mark.timeout(30)
async def test_a_wildcard_subscription_counts_each_subject_apart(nats_server):
    sender, receiver = await pair(nats_server.url)
    deliveries = []

    async def keep(message: Blob, delivery) -> None:
        deliveries.append(delivery.missed)

    await receiver.subscribe(f"{SUBJECT}.*", Blob, keep)
    await receiver.flush()
    for seq, leaf in enumerate("aaabaa"):  # one sender, two subjects, numbered apart: no gap on either
        await sender.publish(f"{SUBJECT}.{leaf}", blob(seq, 10))
    async with asyncio.timeout(10):
        while len(deliveries) < 6:
            await asyncio.sleep(0.02)
    assert deliveries == [0] * 6
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_a_lost_last_message_is_reported_by_the_mark_sent_after_a_reconnect(nats_server):
    sender, receiver = await pair(nats_server.url)
    got, gaps = [], []

    async def keep(message: Blob, _delivery) -> None:
        got.append(message.seq)

    await receiver.subscribe(SUBJECT, Blob, keep, on_gap=gaps.append)
    await receiver.flush()
    publish = sender._nc.publish

    async def lose_the_last_two(subject, payload=b"", reply="", headers=None):
        if not payload or msgspec.msgpack.decode(bytes(payload), type=Blob).seq < 1:
            await publish(subject, payload, reply, headers)

    sender._nc.publish = lose_the_last_two  # inside a server that then died, say
    for seq in range(3):
        await sender.publish(SUBJECT, blob(seq, 10))
    sender._mark_sequences_soon()  # what its reconnect does
    async with asyncio.timeout(10):
        while not gaps:
            await asyncio.sleep(0.02)
    assert got == [0] and gaps[0] == sender._sender_id
    await sender.close()
    await receiver.close()
