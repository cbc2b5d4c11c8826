"""A stand-in scheduler that answers each `GenerateRequest` with the recorded scheduler output.

It claims, answers pings and beats like the recorded scheduler (same instance id), and when a
request arrives it finds the recorded request it repeats and publishes that request's recorded
`TokenBatch` messages, raw: the recorded bytes and headers, every chunk of a framed message in
order. Native cases carry fixed rids; OpenAI endpoints make a fresh rid per call, so a request is
matched by its content (everything but the rid) and the rid inside the recorded bytes is swapped
for the live one (same length: msgpack sizes, chunk sizes and headers stay as recorded).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats
import numpy as np
from nats.aio.client import Client

from contracts import subjects
from contracts.detokenizer import Finish, FinishType, TokenBatch
from contracts.scheduler import GenerateRequest, SchedulerClaim, SchedulerClaimReply, SchedulerInfo, SchedulerPing
from services.common.arrays import to_wire
from services.common.framing import CHUNK_HEADER, MSG_HEADER
from services.common.heartbeat import HeartbeatPublisher
from services.common.nats_reader import Delivery
from services.common.transport import Transport
from services.recorder.format import RecordedMessage, read_recording

Parts = list[RecordedMessage]  # one logical message: its chunks in order (one part if unframed)
Rewrite = Callable[[list[Parts]], list[Parts]]  # a request's batches -> changed ones


@dataclass
class RecordedRequest:
    rid: str
    key: bytes  # the GenerateRequest with an empty rid, encoded: what matches a live request
    batches: list[Parts] = field(default_factory=list)  # its TokenBatch messages, in recorded order


def request_key(request: GenerateRequest) -> bytes:
    return msgspec.msgpack.encode(msgspec.structs.replace(request, rid=""))


def logical_messages(messages: list[RecordedMessage]) -> Iterator[Parts]:
    """Recorded messages grouped into logical messages (framed chunks joined by `Sw-Msg`)."""
    open_frames: dict[str, Parts] = {}
    for message in messages:
        msg_id = (message.headers or {}).get(MSG_HEADER)
        if msg_id is None:
            yield [message]
            continue
        parts = open_frames.setdefault(msg_id, [])
        parts.append(message)
        if len(parts) == int(message.headers[CHUNK_HEADER].split("/")[1]):  # type: ignore[index]
            yield open_frames.pop(msg_id)


def payload(parts: Parts) -> bytes:
    return b"".join(part.data for part in parts)


def load_requests(path: Path, scheduler_id: str, detokenizer_id: str) -> list[RecordedRequest]:
    """Recorded requests with their token batches; each recorded batch must hold one request."""
    requests: dict[str, RecordedRequest] = {}
    generate, tokens = subjects.scheduler_generate(scheduler_id), subjects.detokenizer_tokens(detokenizer_id)
    for parts in logical_messages(read_recording(path).messages):
        if parts[0].subject == generate:
            request = msgspec.msgpack.decode(payload(parts), type=GenerateRequest)
            requests[request.rid] = RecordedRequest(request.rid, request_key(request))
        elif parts[0].subject == tokens:
            batch = msgspec.msgpack.decode(payload(parts), type=TokenBatch)
            if len(batch.rids) != 1:
                raise ValueError(f"recorded batch {batch.step} mixes requests {batch.rids}: record cases one at a time")
            requests[batch.rids[0]].batches.append(parts)
    return list(requests.values())


def with_rid(parts: Parts, old: str, new: str) -> Parts:
    """The same message with `new` in place of the rid `old`, split at the recorded chunk sizes
    (a rid of another length changes the last chunk's size only)."""
    if old == new:
        return parts
    old_bytes, new_bytes = msgspec.msgpack.encode(old), msgspec.msgpack.encode(new)
    data = payload(parts)
    if data.count(old_bytes) != 1:
        raise ValueError(f"rid {old!r} is not exactly once in its recorded batch")
    data = data.replace(old_bytes, new_bytes)
    out, start = [], 0
    for index, part in enumerate(parts):
        end = len(data) if index == len(parts) - 1 else start + len(part.data)
        out.append(msgspec.structs.replace(part, data=data[start:end]))
        start = end
    return out


def abort_batch(scheduler_id: str, rid: str, message: str) -> bytes:
    """What a live request with no recording gets: an abort that says so (never a hang)."""
    empty = to_wire(np.zeros(0, np.int32))  # [0]
    finish = Finish(FinishType.ABORT, message=message)
    batch = TokenBatch(scheduler_id, 0, [rid], to_wire(np.zeros(1, np.int32)), empty, to_wire(np.ones(1, np.int32)), [finish])
    return msgspec.msgpack.encode(batch)


class ReplayScheduler:
    def __init__(self, transport: Transport, raw: Client, recorded: list[RecordedRequest], instance_id: str) -> None:
        self.transport = transport
        self.raw = raw  # plain connection: recorded bytes go out with their recorded headers
        self.instance_id = instance_id
        self.heartbeat = HeartbeatPublisher(transport, "scheduler", instance_id, 0.5)
        self.by_key: dict[bytes, list[RecordedRequest]] = {}
        for request in recorded:
            self.by_key.setdefault(request.key, []).append(request)
        self.rewrite: Rewrite | None = None  # a change to the batches of every request played (failure tests)
        self.unmatched: list[str] = []

    @classmethod
    async def start(cls, nats_url: str, recording: Path, instance_id: str, detokenizer_id: str) -> ReplayScheduler:
        transport = await Transport.connect(nats_url, f"replay-scheduler-{instance_id}")
        raw = await nats.connect(nats_url, name="replay-scheduler-raw")
        scheduler = cls(transport, raw, load_requests(recording, instance_id, detokenizer_id), instance_id)
        t = transport
        await t.subscribe(subjects.SCHEDULER_CLAIM, SchedulerClaim, scheduler._on_claim, queue=subjects.SCHEDULER_QUEUE)
        await t.subscribe(subjects.SCHEDULER_PING, SchedulerPing, scheduler._on_ping, queue=subjects.SCHEDULER_QUEUE)
        await t.subscribe(subjects.scheduler_generate(instance_id), GenerateRequest, scheduler._on_generate)
        scheduler.heartbeat.start()
        return scheduler

    async def stop(self) -> None:
        await self.heartbeat.stop("replay finished")
        await self.raw.close()
        await self.transport.close()

    def match(self, request: GenerateRequest) -> RecordedRequest | None:
        candidates = self.by_key.get(request_key(request), [])
        return next((c for c in candidates if c.rid == request.rid), candidates[0] if candidates else None)

    async def _on_claim(self, _claim: SchedulerClaim, msg: Delivery) -> None:
        await self.transport.respond(msg, SchedulerClaimReply(self.instance_id))

    async def _on_ping(self, _ping: SchedulerPing, msg: Delivery) -> None:
        await self.transport.respond(msg, SchedulerInfo(self.instance_id, "replay", 32768, 2048))

    async def _on_generate(self, request: GenerateRequest, _msg: Delivery) -> None:
        subject = subjects.detokenizer_tokens(request.detokenizer_id)
        recorded = self.match(request)
        if recorded is None:
            self.unmatched.append(request.rid)
            await self.raw.publish(subject, abort_batch(self.instance_id, request.rid, "no recorded stream matches"))
            return
        batches = recorded.batches if self.rewrite is None else self.rewrite(recorded.batches)
        for parts in batches:
            for part in with_rid(parts, recorded.rid, request.rid):
                await self.raw.publish(subject, part.data, headers=part.headers or None)
        await self.raw.flush()


class BackgroundLoop:
    """An asyncio loop in a thread, so synchronous tests can keep a stand-in running."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="replay-loop", daemon=True)
        self._thread.start()

    def run(self, coro, timeout_s: float = 30.0):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
        self.loop.close()
