"""Transport hardening against a real nats-server: header-exact chunking, flow control,
stale reassemblies, too-large requests."""

from __future__ import annotations

import asyncio
import time

import msgspec
import nats.errors
import pytest

from services.common.framing import CHUNK_HEADER, MSG_HEADER, header_block_size, plan_chunks
from services.common.transport import PayloadTooLarge, ReceiverGone, Transport

MB = 1024 * 1024
SUBJECT = "sparkwire.v1.test.direct"


class Blob(msgspec.Struct):
    seq: int
    data: bytes


def blob(seq: int, size: int) -> Blob:
    return Blob(seq, (seq % 251).to_bytes(1, "little") * size)


class Collector:
    """A subscription handler that keeps what it got; `block_s` stalls the whole event loop."""

    def __init__(self, block_s: float = 0.0) -> None:
        self.got: list[Blob] = []
        self.block_s = block_s
        self.changed = asyncio.Event()

    async def __call__(self, message: Blob, _msg) -> None:
        if self.block_s:
            time.sleep(self.block_s)  # like CPU-heavy work on the receiver: the socket is not read
        self.got.append(message)
        self.changed.set()

    async def wait_for(self, count: int, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while len(self.got) < count:
                self.changed.clear()
                await self.changed.wait()


async def pair(url: str, **options) -> tuple[Transport, Transport]:
    return await Transport.connect(url, "sender", **options), await Transport.connect(url, "receiver", **options)


async def subscribed_pair(url: str, block_s: float = 0.0, **options) -> tuple[Transport, Transport, Collector]:
    """A sender, and a receiver whose subscription to SUBJECT collects `Blob`s and is live."""
    sender, receiver = await pair(url, **options)
    got = Collector(block_s=block_s)
    await receiver.subscribe(SUBJECT, Blob, got)
    await receiver.flush()
    return sender, receiver, got


def record_commands(transport: Transport) -> list[tuple[int, int]]:
    """(header bytes, header + payload bytes) of every HPUB the client writes to its socket
    (nats-py's flusher hands its writer whole commands: a PUB/HPUB line, then its payload)."""
    sent: list[tuple[int, int]] = []
    writer = transport._nc._transport
    original = writer.writelines

    def spy(parts) -> None:
        stream, start = b"".join(parts), 0
        while start < len(stream):
            line_end = stream.index(b"\r\n", start)
            words = stream[start:line_end].split()
            start = line_end + 2
            if words[0] == b"HPUB":
                sent.append((int(words[-2]), int(words[-1])))
            if words[0] in (b"HPUB", b"PUB"):
                start += int(words[-1]) + 2
        original(parts)

    writer.writelines = spy
    return sent


@pytest.mark.timeout(30)
async def test_header_block_size_is_what_nats_py_sends(nats_server):
    sender = await Transport.connect(nats_server.url, "sender")
    sent = record_commands(sender)
    headers = {MSG_HEADER: "abc-1", CHUNK_HEADER: "03/17", "Sw-Ack": "_INBOX.xyz"}
    await sender._nc.publish(SUBJECT, b"x", headers=headers)
    await sender._nc.flush()
    assert sent == [(header_block_size(headers), header_block_size(headers) + 1)]
    await sender.close()


@pytest.mark.timeout(30)
async def test_chunks_fill_max_payload_exactly_headers_included(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    sender, receiver, got = await subscribed_pair(server.url)
    sent = record_commands(sender)
    message = blob(7, 3 * MB + 12345)
    await sender.publish(SUBJECT, message)
    await got.wait_for(1, 10)
    assert got.got == [message]
    totals = [total for _hdr, total in sent]
    assert max(totals) == sender.max_payload  # full chunks sit exactly at the limit, headers included
    assert all(hdr > 0 for hdr, _total in sent)
    assert sender.events.disconnects == 0 and sender.events.errors == []
    assert "maximum payload" not in server.log().lower()
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_one_byte_over_the_limit_is_refused_by_the_server(nats_server_factory):
    """The control for the test above: the server does count headers, so exact sizing matters."""
    server = nats_server_factory(max_payload="1MB")
    sender = await Transport.connect(server.url, "sender")
    headers = {MSG_HEADER: "m-0", CHUNK_HEADER: "0/2"}
    payload = b"x" * (sender.max_payload - header_block_size(headers) + 1)
    await sender._nc.publish(SUBJECT, payload, headers=headers)  # passes nats-py's payload-only check
    async with asyncio.timeout(5):
        while sender.events.disconnects == 0 and "maximum payload" not in server.log().lower():
            await asyncio.sleep(0.05)
    await sender.close()


def test_plan_chunks_widens_the_chunk_number_when_needed():
    size, num, width = plan_chunks(5 * MB, 1 * MB, "id-1", "_INBOX.a")
    assert (num, width) == (6, 1) and size * num >= 5 * MB
    size, num, width = plan_chunks(50 * MB, 1 * MB, "id-1", "_INBOX.a")
    assert width == 2 and num == 51 and size * num >= 50 * MB and size * (num - 1) < 50 * MB


@pytest.mark.timeout(30)
async def test_5mb_message_through_1mb_server_arrives_intact(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    sender, receiver, got = await subscribed_pair(server.url)
    message = Blob(1, bytes(range(256)) * (5 * MB // 256))
    await sender.publish(SUBJECT, message)
    await got.wait_for(1, 10)
    assert got.got == [message]
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(60)
async def test_burst_of_20_5mb_messages_arrives_intact_and_in_order(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    sender, receiver, got = await subscribed_pair(server.url)
    sent = [blob(seq, 5 * MB) for seq in range(20)]
    for message in sent:
        await sender.publish(SUBJECT, message)
    await got.wait_for(20, 40)
    assert [m.seq for m in got.got] == list(range(20))
    assert got.got == sent
    await sender.close()
    await receiver.close()


def socket_of(receiver: Transport) -> asyncio.Transport:
    """The receiving socket (its `NatsReader`'s): `pause_reading()` stops only this receiver.
    A blocked event loop would not do: sender and receiver share it, so the sender stops too."""
    return receiver._reader._protocol.transport


def window_is_full(sender: Transport, window_bytes: int) -> bool:
    """No room for another chunk (a chunk is at most `max_payload`): the sender waits for acks."""
    window = sender._send.windows.get(SUBJECT)
    return window_bytes > 0 and window is not None and window_bytes - window.num_bytes < sender.max_payload


async def _burst_21mb(server, window_bytes: int) -> tuple[Transport, Transport, Collector, asyncio.Task[None]]:
    """Eight 21 MB messages to a receiver that reads nothing until the sender can send no more
    (the whole burst sent, or its window full), then takes 0.3 s per message. Returns once the
    server has everything the sender sent so far, with the receiver reading again, and the
    burst's task (done without flow control; with it, done once the receiver has acked)."""
    sender, receiver, got = await subscribed_pair(server.url, window_bytes=window_bytes, block_s=0.3)
    socket_of(receiver).pause_reading()
    burst = asyncio.create_task(_publish(sender, [blob(seq, 21 * MB) for seq in range(8)]))
    async with asyncio.timeout(30):
        while not burst.done() and not window_is_full(sender, window_bytes):
            await asyncio.sleep(0.01)
    await sender.flush()
    socket_of(receiver).resume_reading()
    return sender, receiver, got, burst


async def _publish(sender: Transport, messages: list[Blob]) -> None:
    for message in messages:
        await sender.publish(SUBJECT, message)


@pytest.mark.timeout(90)
async def test_burst_of_21mb_messages_to_a_slow_receiver_loses_nothing(nats_server_factory):
    server = nats_server_factory(max_payload="1MB", max_pending="16MB")
    sender, receiver, got, burst = await _burst_21mb(server, window_bytes=8 * MB)
    await got.wait_for(8, 60)
    await burst
    assert [m.seq for m in got.got] == list(range(8))
    assert all(len(m.data) == 21 * MB and m.data[:1] == blob(m.seq, 1).data for m in got.got)
    assert receiver.events.disconnects == 0 and receiver.events.errors == []
    assert "slow consumer" not in server.log().lower()
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(90)
async def test_same_burst_without_flow_control_trips_the_slow_consumer_limit(nats_server_factory):
    """The control for the test above: with the window off, the server drops the receiver."""
    server = nats_server_factory(max_payload="1MB", max_pending="16MB")
    sender, receiver, got, _burst = await _burst_21mb(server, window_bytes=0)
    async with asyncio.timeout(30):
        while receiver.events.disconnects == 0:  # the reader sees the close once it reads again
            await asyncio.sleep(0.02)
    slow = [line for line in server.log().splitlines() if "slow consumer" in line.lower()]
    assert slow and all('sparkwire-reader:receiver"' in line for line in slow)
    assert len(got.got) < 8
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_publish_to_a_gone_receiver_raises_instead_of_hanging(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    sender = await Transport.connect(server.url, "sender", window_bytes=2 * MB, ack_timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(ReceiverGone, match=SUBJECT):
        for seq in range(10):  # nobody subscribes, so no ack ever comes
            await sender.publish(SUBJECT, blob(seq, 1 * MB))
    assert time.monotonic() - started < 5
    await sender.close()


@pytest.mark.timeout(30)
async def test_request_over_max_payload_raises_at_once_naming_subject_and_sizes(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    client, responder = await pair(server.url)
    await responder.subscribe(SUBJECT, Blob, lambda _m, _msg: asyncio.sleep(0))
    message = blob(1, 2 * MB)
    size = len(client.encode(message))
    started = time.monotonic()
    with pytest.raises(PayloadTooLarge) as error:
        await client.request(SUBJECT, message, Blob, timeout=30)
    assert time.monotonic() - started < 0.5
    assert SUBJECT in str(error.value) and str(size) in str(error.value) and str(client.max_payload) in str(error.value)
    await client.close()
    await responder.close()


@pytest.mark.timeout(30)
async def test_request_with_nobody_listening_fails_at_once(nats_server):
    client = await Transport.connect(nats_server.url, "client")
    with pytest.raises(nats.errors.NoRespondersError):
        await client.request(SUBJECT, blob(1, 10), Blob, timeout=30)
    await client.close()


async def _send_chunk(nc, msg_id: str, index: int, data: bytes) -> None:
    await nc.publish(SUBJECT, data, headers={MSG_HEADER: msg_id, CHUNK_HEADER: f"{index}/2"})


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pause_s, delivered", [(0.0, True), (1.0, False)])
async def test_stale_partial_reassembly_is_dropped(nats_server, pause_s, delivered):
    sender, receiver, got = await subscribed_pair(nats_server.url, reassembly_timeout_s=0.4)
    payload = msgspec.msgpack.encode(blob(3, 1000))
    half = -(-len(payload) // 2)  # as the sender plans chunks: no chunk larger than the first
    await _send_chunk(sender._nc, "m-1", 0, payload[:half])
    await sender.flush()
    await asyncio.sleep(pause_s)  # longer than the reassembly timeout: the first half is dropped
    await _send_chunk(sender._nc, "m-1", 1, payload[half:])
    await sender.publish(SUBJECT, blob(4, 10))  # handled after the second half: what came of it is known then
    await got.wait_for(2 if delivered else 1, 10)
    assert got.got == ([blob(3, 1000)] if delivered else []) + [blob(4, 10)]
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_acks_give_the_whole_window_back_after_delivery(nats_server):
    sender, receiver, got = await subscribed_pair(nats_server.url)
    sent = record_commands(sender)
    for seq in range(3):
        await sender.publish(SUBJECT, blob(seq, 1 * MB))  # under max_payload (8 MB), still framed
    await got.wait_for(3, 10)
    assert len(sent) == 3  # one framed message each, with headers
    async with asyncio.timeout(5):
        while sender._send.windows[SUBJECT].num_bytes:
            await asyncio.sleep(0.02)
    assert sender._send.ack_keys == {}
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_settled_returns_once_the_receiver_handled_every_framed_message(nats_server):
    sender, receiver, got = await subscribed_pair(nats_server.url, block_s=0.05, ack_timeout_s=0.5)
    for seq in range(4):
        await sender.publish(SUBJECT, blob(seq, 1 * MB))
    await sender.settled(SUBJECT)
    assert [message.seq for message in got.got] == [0, 1, 2, 3]  # handled, not only sent
    await sender.publish("sparkwire.v1.test.nobody", blob(4, 1 * MB))
    with pytest.raises(ReceiverGone, match="nobody"):
        await sender.settled("sparkwire.v1.test.nobody")
    await sender.settled("sparkwire.v1.test.never_sent_to")
    await sender.close()
    await receiver.close()
