"""A message as several buffers (services/common/scatter.py): the same bytes as msgspec's encoding
without copying the large field, and the same message on the wire as nats-py's publish."""

from __future__ import annotations

import asyncio

import msgspec
import nats
import numpy as np
import pytest

from contracts.weights import WeightMessage, WeightPiece, WeightTarget
from services.common.scatter import encode_parts, publish_parts
from services.common.scatter import byte_range
from services.common.transport import Transport

MB = 1024 * 1024
SUBJECT = "sparkwire.v1.test.scatter"


def piece(data: np.ndarray) -> WeightPiece:
    return WeightPiece("push-1", WeightTarget.MODEL, "model.layers.0.mlp.up_proj.weight", "bfloat16", (data.size // 2,), 4096, 2**64 - 1,
                       memoryview(data))  # fmt: skip


@pytest.mark.parametrize("size", [0, 5, 255, 256, 65535, 65536, 3 * MB])  # every msgpack bin header width
def test_parts_are_the_encoding_and_the_field_is_not_copied(size):
    data = (np.arange(size) % 251).astype(np.uint8)
    encoder = msgspec.msgpack.Encoder()
    parts = encode_parts(encoder, piece(data))
    assert b"".join(parts) == encoder.encode(piece(data))
    assert msgspec.msgpack.decode(b"".join(parts), type=WeightMessage) == piece(data)
    if size:
        data[0] ^= 1  # the second part is a view of the tensor's bytes
        assert parts[1][0] == data[0]


def test_a_message_whose_last_field_is_not_encoded_last_as_bytes_is_refused():
    class CountLast(msgspec.Struct):
        data: bytes
        count: int

    class Omitted(msgspec.Struct, omit_defaults=True):
        count: int
        data: bytes = b""

    with pytest.raises(TypeError):
        encode_parts(msgspec.msgpack.Encoder(), CountLast(b"x", 1))
    with pytest.raises(TypeError, match="not encoded last"):
        encode_parts(msgspec.msgpack.Encoder(), Omitted(1, b"xyz"))


def test_byte_range_spans_parts():
    parts = [memoryview(b"abc"), memoryview(b""), memoryview(b"defgh")]
    assert [bytes(v) for v in byte_range(parts, 2, 6)] == [b"c", b"def"]
    assert b"".join(byte_range(parts, 0, 100)) == b"abcdefgh"
    assert byte_range(parts, 8, 9) == []


@pytest.mark.timeout(30)
async def test_publish_parts_is_what_nats_py_publish_sends(nats_server):
    receiver = await nats.connect(nats_server.url)
    subscription = await receiver.subscribe(SUBJECT)
    await receiver.flush()
    sender = await Transport.connect(nats_server.url, "sender")
    headers = {"Sw-Msg": "abc-1", "Sw-Chunk": "0/1"}
    data = np.arange(300_000, dtype=np.uint8)
    await publish_parts(sender._nc, SUBJECT, headers, [b"head", memoryview(data)[:1000], memoryview(data)[1000:]])
    await sender._nc.publish(SUBJECT, b"head" + data.tobytes(), headers=headers)
    scattered, whole = [await subscription.next_msg(timeout=5) for _ in range(2)]
    assert scattered.data == whole.data == b"head" + data.tobytes()
    assert scattered.headers == whole.headers == headers
    await sender.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_a_piece_in_parts_crosses_chunk_boundaries_and_arrives_whole(nats_server_factory):
    """Through a 1 MB server a 3 MB piece is framed: chunks cut across its header and data parts."""
    server = nats_server_factory(max_payload="1MB")
    sender, receiver = await Transport.connect(server.url, "sender"), await Transport.connect(server.url, "receiver")
    got: asyncio.Queue[WeightPiece] = asyncio.Queue()

    async def handler(message: WeightPiece, _msg) -> None:
        await got.put(message)

    await receiver.subscribe(SUBJECT, WeightMessage, handler)
    await receiver.flush()
    data = (np.arange(3 * MB + 17) % 253).astype(np.uint8)
    await sender.publish(SUBJECT, encode_parts(msgspec.msgpack.Encoder(), piece(data)))
    arrived = await asyncio.wait_for(got.get(), 10)
    assert arrived == piece(data) and sender.events.traffic.chunks_sent == 4
    await sender.close()
    await receiver.close()
