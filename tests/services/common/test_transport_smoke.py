import asyncio

import msgspec

from contracts.control import Heartbeat
from services.common.transport import Transport


async def test_publish_subscribe_roundtrip(nats_server):
    a = await Transport.connect(nats_server.url, "a")
    b = await Transport.connect(nats_server.url, "b")
    got: asyncio.Queue[Heartbeat] = asyncio.Queue()

    async def handler(message: Heartbeat, _msg) -> None:
        got.put_nowait(message)

    await b.subscribe("sparkwire.v1.test", Heartbeat, handler)
    await b.flush()
    await a.publish("sparkwire.v1.test", Heartbeat(service="x", instance_id="1", num_running=3))
    message = await asyncio.wait_for(got.get(), 5)
    assert message == Heartbeat(service="x", instance_id="1", num_running=3)
    await a.close()
    await b.close()


async def test_large_payload_is_chunked_under_1mb_limit(nats_server_factory):
    server = nats_server_factory(max_payload="1MB")
    a = await Transport.connect(server.url, "a")
    b = await Transport.connect(server.url, "b")
    assert a.max_payload == 1024 * 1024
    got: asyncio.Queue[bytes] = asyncio.Queue()

    class Blob(msgspec.Struct):
        data: bytes

    async def handler(message: Blob, _msg) -> None:
        got.put_nowait(message.data)

    await b.subscribe("sparkwire.v1.blob", Blob, handler)
    await b.flush()
    payload = bytes(range(256)) * (5 * 4096)  # 5 MiB
    await a.publish("sparkwire.v1.blob", Blob(payload))
    assert await asyncio.wait_for(got.get(), 10) == payload
    await a.close()
    await b.close()
