"""Where a request goes: one detokenizer registers it, one scheduler claims it (load-aware: a
scheduler without room answers `busy` and the claim is asked again), and the `GenerateRequest`
the claiming scheduler gets.

Cache-aware: every scheduler broadcasts a summary of the KV blocks it caches (`PrefixSummary`);
a claim goes first, directly, to the scheduler whose summary holds the longest prefix of the
prompt's blocks, unless its load (as summarized, plus the requests placed there since) is far
above the least loaded one's; a busy answer, or no fresh summary holding any block, falls back to
the queue group. Only the latest summary is read, never waited for; an old one is ignored."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import numpy as np

from contracts import subjects
from contracts.detokenizer import DetokenizerRegistration, DetokenizerRegistrationReply
from contracts.scheduler import FlushCache, ForkedChoice, GenerateRequest, SchedulerClaim, SchedulerClaimReply
from contracts.tokenizer import PrefixSummary
from services.common.arrays import from_wire, to_wire
from services.common.block_hash import block_hashes
from services.common.nats_reader import Delivery
from services.common.logging import request_headers
from services.common.transport import Transport
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.requests import PendingRequest
from services.tokenizer.invalid import InvalidRequest
from services.tokenizer.validation import GenerationSpec

CLAIM_RETRY_FIRST_S = 0.002  # pauses between claims that found no room: 0, 2, 4, ... 25 ms
CLAIM_RETRY_MAX_S = 0.025  # short: a scheduler that frees a slot idles until the next claim arrives
SUMMARY_STALE_S = 3.0  # a prefix summary older than this is ignored (its scheduler may be gone)


class ServiceUnavailable(Exception):
    """No scheduler or detokenizer can take the request now (HTTP 503)."""


class _Held:
    """One scheduler's latest prefix summary, as a set, and the requests placed there since."""

    def __init__(self, summary: PrefixSummary) -> None:
        self.summary = summary
        self.hashes = set(from_wire(summary.hashes).tolist())
        self.received_at = time.monotonic()
        self.num_placed = 0

    def load(self) -> int:
        return self.summary.num_held + self.num_placed

    def num_matched(self, prompt_ids: tuple[int, ...], chains: dict[tuple[int, int], list[int]]) -> int:
        """Leading blocks of the prompt this scheduler caches (`chains`: the prompt's hashes by (block size, salt), filled here)."""
        key = (self.summary.block_size, self.summary.salt)
        if key not in chains:
            chains[key] = block_hashes(prompt_ids, *key)
        count = 0
        for h in chains[key]:
            if h & 0xFFFFFFFF not in self.hashes:
                break
            count += 1
        return count


class Placement:
    def __init__(self, config: TokenizerConfig, transport: Transport) -> None:
        self.config = config
        self._transport = transport
        self._held: dict[str, _Held] = {}  # scheduler id -> its latest summary

    async def on_summary(self, summary: PrefixSummary, _msg: Delivery) -> None:
        self._held[summary.scheduler_id] = _Held(summary)

    async def flush_caches(self) -> None:
        """Every scheduler forgets its prefix cache (POST /flush_cache)."""
        await self._transport.publish(subjects.SCHEDULER_FLUSH_CACHE, FlushCache(time.time()))
        self._held.clear()

    def holder(self, prompt_ids: tuple[int, ...]) -> str | None:
        """The scheduler to ask first: the one caching the longest prefix of `prompt_ids`, unless
        it has no room or is far busier than the least busy; None: ask the queue group."""
        now = time.monotonic()
        fresh = {sid: held for sid, held in self._held.items() if now - held.received_at < SUMMARY_STALE_S}
        chains: dict[tuple[int, int], list[int]] = {}  # schedulers of one model share one chain: hashed once
        matched = {sid: held.num_matched(prompt_ids, chains) for sid, held in fresh.items()}
        best = max(matched, key=matched.__getitem__, default=None)
        if best is None or matched[best] == 0:
            return None
        held, least = fresh[best], min(h.load() for h in fresh.values())
        if held.load() >= held.summary.max_running or held.load() - least > held.summary.max_running // 2:
            return None
        return best

    async def register_all(self, pendings: list[PendingRequest]) -> None:
        ids = await asyncio.gather(*(self._register(p.spec) for p in pendings), return_exceptions=True)
        for pending, detokenizer_id in zip(pendings, ids, strict=True):
            if isinstance(detokenizer_id, str):
                pending.detokenizer_id = detokenizer_id
        for error in ids:
            if isinstance(error, BaseException):
                raise error

    async def _register(self, spec: GenerationSpec) -> str:
        registration = DetokenizerRegistration(spec.rid, self.config.instance_id, spec.detokenize)
        reply = await self._ask(
            subjects.DETOKENIZER_REGISTER, registration, DetokenizerRegistrationReply, "detokenizer", spec.request_id
        )
        return reply.detokenizer_id

    async def claim(self, pending: PendingRequest, forks: list[PendingRequest]) -> SchedulerClaimReply:
        """Load-aware placement (docs/architecture.md): a scheduler without room answers `busy`;
        ask again (the queue group picks a member at random each time) with a growing pause,
        until one with room takes it, or `claim_wait_s` passed and any must (`force`)."""
        spec, choices = pending.spec, _forked_choices(forks)
        direct = await self._claim_holder(pending, choices)
        if direct is not None:
            return direct
        deadline, pause = time.monotonic() + self.config.claim_wait_s, 0.0
        while True:
            force = time.monotonic() >= deadline
            claim = SchedulerClaim(spec.rid, len(spec.prompt_ids), force, pending.detokenizer_id, choices)
            reply = await self._ask(subjects.SCHEDULER_CLAIM, claim, SchedulerClaimReply, "scheduler", spec.request_id)
            if not reply.busy:
                break
            await asyncio.sleep(pause)
            pause = min(max(2 * pause, CLAIM_RETRY_FIRST_S), CLAIM_RETRY_MAX_S)
        if not reply.accepted:
            raise InvalidRequest(reply.error or "the scheduler refused the request")
        return reply

    async def _claim_holder(self, pending: PendingRequest, choices: tuple[ForkedChoice, ...]) -> SchedulerClaimReply | None:
        """A claim to the scheduler holding the prompt's prefix; None where there is none, or it is
        busy, leaving or gone (the queue group answers then, errors included)."""
        spec = pending.spec
        holder = self.holder(spec.prompt_ids)
        if holder is None:
            return None
        claim = SchedulerClaim(spec.rid, len(spec.prompt_ids), False, pending.detokenizer_id, choices)
        try:
            reply = await self._ask(subjects.scheduler_claim(holder), claim, SchedulerClaimReply, "scheduler", spec.request_id)
        except ServiceUnavailable:
            self._held.pop(holder, None)
            return None
        if not reply.accepted:
            return None
        if holder in self._held:
            self._held[holder].num_placed += 1
        return reply

    async def _ask(self, subject: str, message: object, reply_type: type, who: str, request_id: str):  # type: ignore[no-untyped-def]
        timeout, headers = self.config.request_timeout_s, request_headers(request_id)
        try:
            return await self._transport.request(subject, message, reply_type, timeout, headers)  # type: ignore[arg-type]
        except nats.errors.NoRespondersError:
            raise ServiceUnavailable(f"no {who} is running; try again once one is up") from None
        except (nats.errors.TimeoutError, asyncio.TimeoutError):
            raise ServiceUnavailable(f"no {who} answered within {timeout}s") from None


def generate_request(pendings: list[PendingRequest]) -> GenerateRequest:
    first, spec = pendings[0], pendings[0].spec
    ids = to_wire(np.asarray(spec.prompt_ids, dtype=np.int32))  # [num_prompt_tokens]
    choices = _forked_choices(pendings[1:])
    return GenerateRequest(spec.rid, ids, first.detokenizer_id, spec.sampling, spec.logprobs, spec.stream, choices)


def _forked_choices(pendings: list[PendingRequest]) -> tuple[ForkedChoice, ...]:
    return tuple(ForkedChoice(p.rid, p.detokenizer_id, p.spec.sampling.seed) for p in pendings)
