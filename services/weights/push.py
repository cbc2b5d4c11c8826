"""The trainer's side of a weight push: a state dict (name -> tensor) to every live scheduler.

A `WeightManifest` (every tensor's name, shape and dtype) goes first, so each scheduler allocates
its buffers while the pieces travel. Each tensor travels as `WeightPiece`s (its raw bytes and their
xxh3-64) on each scheduler's direct weights subject, framed and flow controlled by the transport (a
scheduler that reads slowly slows the push down instead of piling bytes up in NATS); then one
`WeightCommit` request per scheduler, answered once that scheduler swapped (or refused: a piece
lost or corrupt, a name or shape the served model does not have; it keeps its old weights). A piece
is as large as still travels as one NATS message, hashed once and sent as its small header and a
view of the tensor's bytes (`scatter.encode_parts`) to every scheduler: no copy of the tensor's
bytes on this side.

Pieces are striped over several NATS connections (`num_connections`, one per `CORES_PER_CONNECTION`
cores by default): nats-server reads and routes each client connection's messages in one
goroutine, so one connection caps a push at what one of its cores copies. Pieces can take any
path: each names its tensor and offset and is checked alone, so only the commit has to come after
all of them: it leaves once the scheduler acked every piece of the other connections (they may
reach it through other servers of a cluster, and a flush to one server orders nothing there).
The transport acks only the messages it frames (`FRAMED_MIN_BYTES` on): a smaller piece rides on
the first connection, in order with the commit.
Each connection is its own flow-control sender: at most `num_connections` windows of unacked
bytes per scheduler.

    async with await WeightPusher.connect("nats://127.0.0.1:4222") as pusher:
        replies = await pusher.push(model.state_dict(), weight_version="step-12")
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
import uuid
from collections.abc import Iterable, Iterator, Mapping, Sequence

import msgspec
import torch
import xxhash

from contracts import subjects
from contracts.weights import ControlReply, TensorSpec, WeightCommit, WeightManifest, WeightPiece, WeightTarget
from services.common.connection import NatsConnection
from services.common.heartbeat import HeartbeatMonitor
from services.common.scatter import encode_parts
from services.common.transport import FRAMED_MIN_BYTES, Transport

PIECE_ALIGN = 64 << 10  # pieces start at aligned offsets of the tensor (whole pages for the copies)
PIECE_HEADROOM = 16 << 10  # a piece's header (a tensor name of up to 4 KiB) and the transport's framing headers
COMMIT_TIMEOUT_S = 600.0  # requests in flight finish on the old weights before the swap
DISCOVERY_S = 5.0  # how long to listen for scheduler heartbeats at most
QUIET_S = 1.5  # no new scheduler heard for this long (three default heartbeat intervals): all are known
CORES_PER_CONNECTION = 4  # a connection keeps a core of nats-server's busy and part of ours; the rest serve the receiver
MAX_CONNECTIONS = 4  # the scheduler reads every piece on one connection: more senders only queue there


class PushFailed(RuntimeError):
    """At least one scheduler refused the version or did not answer; `replies` says which."""

    def __init__(self, replies: dict[str, ControlReply | str]) -> None:
        refused = {sid: r if isinstance(r, str) else r.error for sid, r in replies.items() if isinstance(r, str) or not r.ok}
        super().__init__(f"weights refused by {len(refused)} of {len(replies)} schedulers: {refused}")
        self.replies = replies


def default_connections() -> int:
    """NATS connections for a push on this machine: one per `CORES_PER_CONNECTION` cores, 1 to `MAX_CONNECTIONS`."""
    return max(1, min(MAX_CONNECTIONS, len(os.sched_getaffinity(0)) // CORES_PER_CONNECTION))


def piece_bytes_for(max_payload: int) -> int:
    """The most tensor bytes of a piece that still travels as one NATS message of `max_payload`."""
    return max(PIECE_ALIGN, (max_payload - PIECE_HEADROOM) // PIECE_ALIGN * PIECE_ALIGN)


def pieces(tensors: Mapping[str, torch.Tensor], push_id: str, target: WeightTarget, piece_bytes: int) -> Iterator[WeightPiece]:
    """Every tensor's bytes as pieces (host, contiguous; the tensor's own dtype)."""
    for name, tensor in tensors.items():
        host = tensor.detach().to("cpu").contiguous()
        raw = host.view(torch.uint8).reshape(-1).numpy() if host.numel() else host.numpy().view("u1")
        dtype = str(host.dtype).removeprefix("torch.")
        for offset in range(0, max(raw.size, 1), piece_bytes):
            data = memoryview(raw[offset : offset + piece_bytes])  # no copy, here or when sent
            yield WeightPiece(push_id, target, name, dtype, tuple(host.shape), offset, xxhash.xxh3_64_intdigest(data), data)


def manifest(tensors: Mapping[str, torch.Tensor], push_id: str, target: WeightTarget) -> WeightManifest:
    specs = (TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape)) for name, t in tensors.items())
    return WeightManifest(push_id, target, tuple(specs))


class WeightPusher:
    def __init__(self, transports: Sequence[Transport]) -> None:
        self.transports = list(transports)  # the pieces are striped over all of them
        self.transport = self.transports[0]  # discovery and the commits
        self.piece_bytes = piece_bytes_for(min(t.max_payload for t in self.transports))
        self._encoder = msgspec.msgpack.Encoder()

    @classmethod
    async def connect(cls, connection: NatsConnection | str, num_connections: int | None = None) -> WeightPusher:
        """`num_connections`: default `default_connections()`."""
        name, transports = f"weights-pusher-{uuid.uuid4().hex[:8]}", []
        try:
            for index in range(num_connections or default_connections()):
                transports.append(await Transport.connect(connection, f"{name}-{index}"))
        except BaseException:
            await asyncio.gather(*(transport.close() for transport in transports))
            raise
        return cls(transports)

    async def __aenter__(self) -> WeightPusher:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await asyncio.gather(*(transport.close() for transport in self.transports))

    async def schedulers(self, wait_s: float = DISCOVERY_S) -> list[str]:
        """The live schedulers, from their heartbeats: listening until none new was heard for
        `QUIET_S` after the first, or `wait_s` at most."""
        monitor = HeartbeatMonitor(self.transport, "scheduler", wait_s * 4, lambda *_: None)
        await monitor.start()
        try:
            deadline, known, quiet_since = time.monotonic() + wait_s, set(), time.monotonic()
            while time.monotonic() < deadline and not (known and time.monotonic() - quiet_since > QUIET_S):
                await asyncio.sleep(0.05)
                if (alive := set(monitor.alive_instances())) != known:
                    known, quiet_since = alive, time.monotonic()
            return sorted(known)
        finally:
            await monitor.stop()

    async def push(
        self, tensors: Mapping[str, torch.Tensor], weight_version: str | None = None, *,
        target: WeightTarget = WeightTarget.MODEL, abort_all_requests: bool = False, scheduler_ids: list[str] | None = None,
    ) -> dict[str, ControlReply]:  # fmt: skip
        """Push to every live scheduler (or `scheduler_ids`); raises `PushFailed` unless all swapped."""
        ids = scheduler_ids if scheduler_ids is not None else await self.schedulers()
        if not ids:
            raise PushFailed({})
        push_id = uuid.uuid4().hex
        commit = WeightCommit(push_id, tuple(tensors), weight_version, target, abort_all_requests)
        parts = pieces(tensors, push_id, target, self.piece_bytes)
        answered = await self.send(ids, parts, commit, manifest(tensors, push_id, target))
        if any(isinstance(r, str) or not r.ok for r in answered.values()):
            raise PushFailed(answered)
        return answered  # type: ignore[return-value]

    async def send(
        self, scheduler_ids: Sequence[str], parts: Iterable[WeightPiece], commit: WeightCommit, plan: WeightManifest | None = None,
    ) -> dict[str, ControlReply | str]:  # fmt: skip
        """`plan` to every scheduler, then each piece (hashed and encoded once), over whichever
        connection is free first, then the commit to each: each one's reply, or why none came (a
        scheduler gone mid-push gets no more pieces)."""
        gone: dict[str, str] = {}
        if plan is not None:  # on the first connection, ahead of its pieces (those of the others may overtake it)
            payload = self.transport.encode(plan)
            await asyncio.gather(*(self._publish(self.transport, sid, payload, gone) for sid in scheduler_ids))
            await self.transport.flush()
        shared = iter(parts)  # each connection's sender takes the next piece when it is ready for one
        await asyncio.gather(*(self._stream(transport, scheduler_ids, shared, gone) for transport in self.transports))
        await asyncio.gather(*(self._settle(transport, scheduler_ids, gone) for transport in self.transports[1:]))
        live = [sid for sid in scheduler_ids if sid not in gone]
        replies = dict(zip(live, await asyncio.gather(*(self._commit(sid, commit) for sid in live)), strict=True))
        return {sid: gone[sid] if sid in gone else replies[sid] for sid in scheduler_ids}

    async def _stream(self, transport: Transport, scheduler_ids: Sequence[str], parts: Iterator[WeightPiece], gone: dict[str, str]) -> None:
        for piece in parts:
            payload = encode_parts(self._encoder, piece)
            acked = sum(len(part) for part in payload) >= FRAMED_MIN_BYTES
            via = transport if acked else self.transport
            await asyncio.gather(*(self._publish(via, sid, payload, gone) for sid in scheduler_ids if sid not in gone))

    @staticmethod
    async def _settle(transport: Transport, scheduler_ids: Sequence[str], gone: dict[str, str]) -> None:
        """Every scheduler handled the pieces sent on `transport`: the commit (sent on the first
        connection) comes after them. A piece lost on the way is never acked: after the ack
        timeout the commit goes anyway and the scheduler refuses the version as incomplete."""
        for sid in scheduler_ids:
            if sid not in gone:
                with contextlib.suppress(Exception):
                    await transport.settled(subjects.scheduler_weights(sid))

    async def _publish(self, transport: Transport, scheduler_id: str, payload: list, gone: dict[str, str]) -> None:
        try:
            await transport.publish(subjects.scheduler_weights(scheduler_id), payload)
        except Exception as exc:  # a scheduler gone mid-push: reported as its answer
            gone[scheduler_id] = f"no answer: {type(exc).__name__}: {exc}"

    async def _commit(self, scheduler_id: str, commit: WeightCommit) -> ControlReply | str:
        try:
            return await self.transport.request(subjects.scheduler_weights(scheduler_id), commit, ControlReply, COMMIT_TIMEOUT_S)
        except Exception as exc:  # a scheduler gone mid-push: reported as its answer
            return f"no answer: {type(exc).__name__}: {exc}"
