"""The trainer's side of a push (services/weights/push.py) against a real nats-server: pieces
striped over several connections reach one receiver whole, and its commit comes after all of them."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from contracts import subjects
from contracts.weights import ControlReply, WeightCommit, WeightManifest, WeightMessage, WeightPiece, WeightTarget
from services.common.framing import MSG_HEADER
from services.common.nats_reader import Delivery
from services.common.receive import sender_of
from services.common.transport import FRAMED_MIN_BYTES, Transport
from services.scheduler.weights.pieces import PushedVersions
from services.weights.push import WeightPusher, default_connections, pieces

MB = 1 << 20
RECEIVER = "receiver-1"
# 5 pieces a tensor (4 framed and acked by the transport, the last one not), and a 2-element norm
TENSORS = {f"layer.{i}.weight": torch.arange(i, i + 4 * FRAMED_MIN_BYTES // 4 + 1000, dtype=torch.float32).view(-1, 4) for i in range(5)}
TENSORS["norm.weight"] = torch.ones(2)


class Receiver:
    """A scheduler's weights subject without a model (as `SchedulerControls._on_weights`): what
    arrived, from which senders, and what each commit found."""

    def __init__(self, transport: Transport) -> None:
        self.transport = transport
        self.pushed = PushedVersions()
        self.senders: set[str | None] = set()
        self.unacked_senders: set[str | None] = set()  # of the pieces the transport does not ack
        self.swapped: dict[str, torch.Tensor] = {}
        self.manifests: list[WeightManifest] = []

    async def on_weights(self, message: WeightMessage, delivery: Delivery) -> None:
        if isinstance(message, WeightManifest):
            self.manifests.append(message)
            self.pushed.plan(message)
            return
        if isinstance(message, WeightPiece):
            self.senders.add(sender_of(delivery))
            if MSG_HEADER not in (delivery.headers or {}):
                self.unacked_senders.add(sender_of(delivery))
            self.pushed.add(message, delivery.missed)
            return
        try:
            self.swapped = {name: tensor.clone() for name, tensor in self.pushed.take(message).items()}
            reply = ControlReply(RECEIVER, weight_version=message.weight_version or "")
        except ValueError as exc:
            reply = ControlReply(RECEIVER, ok=False, error=str(exc))
        finally:
            self.pushed.recycle()
        await self.transport.respond(delivery, reply)


def delay_writes(transport: Transport, delay_s: float) -> asyncio.Task[None]:
    """Everything `transport` writes reaches the server `delay_s` late, in order (a longer path,
    another server of a cluster): what it sent last is still on the way when the others are done."""
    loop, writes = asyncio.get_running_loop(), asyncio.Queue()
    writer = transport._nc._transport
    write = writer.writelines
    writer.writelines = lambda parts: writes.put_nowait((loop.time() + delay_s, parts))

    async def forward() -> None:
        while True:
            due, parts = await writes.get()
            await asyncio.sleep(due - loop.time())
            write(parts)

    return asyncio.create_task(forward())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("num_connections", [1, 3])
async def test_pieces_striped_over_connections_arrive_whole_before_the_commit(nats_server, num_connections):
    receiver = Receiver(await Transport.connect(nats_server.url, RECEIVER))
    await receiver.transport.subscribe(subjects.scheduler_weights(RECEIVER), WeightMessage, receiver.on_weights)
    await receiver.transport.flush()
    # windows of 4 pieces: every connection gets some; the real default (32 MiB) fills as the receiver reads
    transports = [await Transport.connect(nats_server.url, f"pusher-{i}", window_bytes=MB) for i in range(num_connections)]
    delayed = delay_writes(transports[-1], 0.2)
    async with WeightPusher(transports) as pusher:
        pusher.piece_bytes = FRAMED_MIN_BYTES
        for version in ("v1", "v2"):
            replies = await pusher.push(TENSORS, version, scheduler_ids=[RECEIVER])
            assert replies[RECEIVER].ok and replies[RECEIVER].weight_version == version
            assert receiver.swapped.keys() == TENSORS.keys()
            assert all(torch.equal(receiver.swapped[name], tensor) for name, tensor in TENSORS.items())
    assert [len(m.tensors) for m in receiver.manifests] == [len(TENSORS)] * 2  # each push's manifest went first
    assert len(receiver.senders) == num_connections  # every connection carried pieces
    assert len(receiver.unacked_senders) == 1  # with the commit, on the first connection: in order with it
    delayed.cancel()
    await receiver.transport.close()


@pytest.mark.timeout(60)
async def test_a_corrupt_piece_on_any_connection_is_refused(nats_server):
    receiver = Receiver(await Transport.connect(nats_server.url, RECEIVER))
    await receiver.transport.subscribe(subjects.scheduler_weights(RECEIVER), WeightMessage, receiver.on_weights)
    await receiver.transport.flush()
    async with await WeightPusher.connect(nats_server.url, 3) as pusher:
        parts = list(pieces(TENSORS, "broken", WeightTarget.MODEL, FRAMED_MIN_BYTES))
        parts[-3] = msgspec.structs.replace(parts[-3], xxh3=parts[-3].xxh3 ^ 1)
        reply = (await pusher.send([RECEIVER], iter(parts), WeightCommit("broken", tuple(TENSORS))))[RECEIVER]
    assert not reply.ok and "checksum" in reply.error and receiver.swapped == {}
    await receiver.transport.close()


def test_default_connections_grow_with_the_cores(monkeypatch):
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(2)))
    assert default_connections() == 1
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(16)))
    assert default_connections() == 4
    monkeypatch.setattr("os.sched_getaffinity", lambda _pid: set(range(128)))
    assert default_connections() == 4
