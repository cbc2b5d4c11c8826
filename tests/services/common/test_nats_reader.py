"""`NatsReader`: the hand-written subscriber half of the NATS protocol.

Parser tests feed a recorded-style byte stream to the protocol object in every split; server
tests run against a real nats-server on both event loops the services use.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field

import nats
import pytest

from services.common.lifecycle import EVENT_LOOPS, run_event_loop
from services.common.nats_read_protocol import ReadProtocol, parse_headers
from services.common.nats_reader import Delivery, NatsReader, ReaderEvents


@dataclass
class Sink:
    """A PayloadSink that hands out views of its own buffers, to check zero-copy landing."""

    buffers: list[bytearray] = field(default_factory=list)
    got: list[tuple[Delivery, bytes, bool]] = field(default_factory=list)  # (delivery, payload, landed in our buffer)
    arrived: asyncio.Event | None = None

    def target(self, delivery: Delivery, size: int) -> memoryview:
        self.buffers.append(bytearray(size))
        return memoryview(self.buffers[-1])

    def landed(self, delivery: Delivery, payload: memoryview) -> None:
        ours = payload.obj is self.buffers[-1]
        self.got.append((delivery, bytes(payload), ours))
        if self.arrived is not None:
            self.arrived.set()


class FakeReader:
    def __init__(self, sink: Sink) -> None:
        self.sink = sink
        self.errors: list[str] = []

    def _sink(self, sid: int) -> Sink | None:
        return self.sink if sid == 1 else None

    def _on_server_error(self, message: str) -> None:
        self.errors.append(message)

    def _on_connection_lost(self, protocol: object, exc: Exception | None) -> None:
        pass

    def _on_info(self, info: dict) -> None:
        pass


class FakeTransport:
    def __init__(self) -> None:
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def abort(self) -> None:
        raise AssertionError("the protocol hit an error")


BIG = bytes(range(256)) * 1200  # 300 KiB: larger than the control buffer, so it is read into the target


def hmsg(subject: str, sid: int, reply: str | None, header_block: bytes, payload: bytes) -> bytes:
    reply_part = f" {reply}" if reply else ""
    line = f"HMSG {subject} {sid}{reply_part} {len(header_block)} {len(header_block) + len(payload)}\r\n"
    return line.encode() + header_block + payload + b"\r\n"


STREAM = (
    b'INFO {"server_id":"x","max_payload":1048576}\r\n'
    b"PING\r\n"
    b"MSG a.b 1 5\r\nhello\r\n"
    b"+OK\r\n"
    b"MSG a.b 1 _INBOX.r 0\r\n\r\n"
    + hmsg("a.b", 1, "_INBOX.q", b"NATS/1.0\r\nSw-Msg: m-1\r\nK:  v \r\n\r\n", b"world")
    + b"MSG other 9 3\r\nxyz\r\n"  # a sid nobody subscribed: read and dropped
    + hmsg("a.b", 1, None, b"NATS/1.0\r\nBig: yes\r\n\r\n", BIG)
    + b"PONG\r\n"
    b"-ERR 'Unknown Protocol Operation'\r\n"
)


async def _parse(stream: bytes, piece: int) -> tuple[Sink, FakeReader, FakeTransport, ReadProtocol]:
    sink = Sink()
    reader = FakeReader(sink)
    protocol = ReadProtocol(reader)  # type: ignore[arg-type]
    transport = FakeTransport()
    protocol.connection_made(transport)  # type: ignore[arg-type]
    pong = protocol.ping()
    position = 0
    while position < len(stream):
        buffer = protocol.get_buffer(-1)
        n = min(len(buffer), piece, len(stream) - position)
        buffer[:n] = stream[position : position + n]
        protocol.buffer_updated(n)
        position += n
    assert pong.done() and pong.exception() is None
    return sink, reader, transport, protocol


@pytest.mark.parametrize("piece", [1, 2, 7, 64, 4096, 70_000, 10**7])
async def test_every_split_of_the_stream_parses_the_same(piece):
    sink, reader, transport, protocol = await _parse(STREAM, piece)
    assert json.loads(json.dumps(protocol.info.result()))["max_payload"] == 1048576
    assert transport.written == b"PING\r\nPONG\r\n"  # our ping, then the answer to the server's
    deliveries = [(d.subject, d.reply, d.headers, payload) for d, payload, _ in sink.got]
    assert deliveries == [
        ("a.b", None, None, b"hello"),
        ("a.b", "_INBOX.r", None, b""),
        ("a.b", "_INBOX.q", {"Sw-Msg": "m-1", "K": "v"}, b"world"),
        ("a.b", None, {"Big": "yes"}, BIG),
    ]
    assert all(ours for _, _, ours in sink.got)  # every payload landed in the sink's own buffer
    assert reader.errors == ["Unknown Protocol Operation"]
    assert protocol.start == protocol.end and protocol.incoming is None


async def test_a_large_payload_is_read_straight_into_its_target():
    """After the first control-buffer read, the rest of the payload goes into the target itself."""
    sink = Sink()
    protocol = ReadProtocol(FakeReader(sink))  # type: ignore[arg-type]
    protocol.connection_made(FakeTransport())  # type: ignore[arg-type]
    head = f"MSG a.b 1 {len(BIG)}\r\n".encode()
    first = protocol.get_buffer(-1)
    first[: len(head) + 100] = head + BIG[:100]
    protocol.buffer_updated(len(head) + 100)
    direct = protocol.get_buffer(-1)
    assert direct.obj is sink.buffers[-1] and len(direct) == len(BIG) - 100
    direct[:] = BIG[100:]
    protocol.buffer_updated(len(BIG) - 100)
    tail = protocol.get_buffer(-1)
    tail[:2] = b"\r\n"
    protocol.buffer_updated(2)
    assert sink.got[0][1] == BIG and sink.got[0][2]


async def test_a_payload_without_its_crlf_is_a_protocol_error():
    protocol = ReadProtocol(FakeReader(Sink()))  # type: ignore[arg-type]
    aborted = []
    transport = FakeTransport()
    transport.abort = lambda: aborted.append(True)  # type: ignore[method-assign]
    protocol.connection_made(transport)  # type: ignore[arg-type]
    buffer = protocol.get_buffer(-1)
    data = b"MSG a.b 1 2\r\nokXX"
    buffer[: len(data)] = data
    protocol.buffer_updated(len(data))
    assert aborted == [True]


def test_parse_headers_keeps_status_line_out_and_last_value_wins():
    assert parse_headers(b"NATS/1.0 503\r\nA: 1\r\nA: 2\r\nB:x\r\n\r\n") == {"A": "2", "B": "x"}


@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
def test_messages_from_nats_py_arrive_with_subject_reply_headers_and_queue_groups(nats_server, event_loop):
    async def scenario() -> None:
        sinks = [Sink(arrived=asyncio.Event()) for _ in range(3)]
        readers = [await NatsReader.connect(nats_server.url, f"reader-{i}") for i in range(3)]
        readers[0].subscribe("plain.x", sinks[0])
        for reader, sink in zip(readers[1:], sinks[1:]):
            reader.subscribe("work.x", sink, queue="workers")
        for reader in readers:
            await reader.flush()
        nc = await nats.connect(nats_server.url)
        await nc.publish("plain.x", b"a" * 3_000_000, reply="_INBOX.me", headers={"H": "1"})
        for i in range(10):
            await nc.publish("work.x", str(i).encode())
        await nc.flush()
        await asyncio.wait_for(sinks[0].arrived.wait(), 10)
        async with asyncio.timeout(10):
            while len(sinks[1].got) + len(sinks[2].got) < 10:
                await asyncio.sleep(0.02)
        delivery, payload, _ = sinks[0].got[0]
        assert (delivery.subject, delivery.reply, delivery.headers, payload) == (
            "plain.x", "_INBOX.me", {"H": "1"}, b"a" * 3_000_000
        )
        work = sorted(int(payload) for sink in sinks[1:] for _, payload, _ in sink.got)
        assert work == list(range(10))  # each queue-group message went to exactly one member
        await nc.close()
        for reader in readers:
            await reader.close()
            assert not reader.is_connected

    run_event_loop(scenario(), event_loop)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("event_loop", EVENT_LOOPS)
def test_reconnects_and_resubscribes_after_the_server_restarts(nats_server_factory, event_loop):
    async def scenario() -> None:
        server = nats_server_factory()
        counts = {"down": 0, "up": 0}
        events = ReaderEvents(on_disconnect=lambda: counts.__setitem__("down", counts["down"] + 1),
                              on_reconnect=lambda: counts.__setitem__("up", counts["up"] + 1))  # fmt: skip
        sink = Sink()
        reader = await NatsReader.connect(server.url, "reader", events)
        reader.subscribe("again.x", sink)
        await reader.flush()
        server.kill()
        async with asyncio.timeout(10):
            while counts["down"] == 0:
                await asyncio.sleep(0.02)
        assert not reader.is_connected
        restarted = nats_server_factory(port=server.port)
        async with asyncio.timeout(20):
            while not reader.is_connected:
                await asyncio.sleep(0.05)
        await reader.flush()
        nc = await nats.connect(restarted.url)
        await nc.publish("again.x", b"after")
        await nc.flush()
        async with asyncio.timeout(10):
            while not sink.got:
                await asyncio.sleep(0.02)
        assert sink.got[0][1] == b"after" and counts == {"down": 1, "up": 1}
        await nc.close()
        await reader.close()

    run_event_loop(scenario(), event_loop)


def test_a_refused_connect_raises_instead_of_hanging(nats_server_factory, tmp_path):
    """A server that wants a password refuses the reader's CONNECT with -ERR: the PING fails."""
    server = nats_server_factory(authorization="{ user: a, password: b }")

    async def scenario() -> None:
        with pytest.raises(Exception, match="(?i)authorization|lost"):
            await NatsReader.connect(server.url, "reader")
        reader = await NatsReader.connect(server.url.replace("nats://", "nats://a:b@"), "reader")
        await reader.flush()
        await reader.close()

    run_event_loop(scenario(), "uvloop")
