"""Where a request goes: one detokenizer registers it, one scheduler claims it (load-aware: a
scheduler without room answers `busy` and the claim is asked again), and the `GenerateRequest`
the claiming scheduler gets."""

from __future__ import annotations

import asyncio
import time

import nats.errors
import numpy as np

from contracts import subjects
from contracts.detokenizer import DetokenizerRegistration, DetokenizerRegistrationReply
from contracts.scheduler import ForkedChoice, GenerateRequest, SchedulerClaim, SchedulerClaimReply
from services.common.arrays import to_wire
from services.common.logging import request_headers
from services.common.transport import Transport
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.requests import PendingRequest
from services.tokenizer.validation import GenerationSpec, InvalidRequest

CLAIM_RETRY_FIRST_S = 0.002  # pauses between claims that found no room: 0, 2, 4, ... 25 ms
CLAIM_RETRY_MAX_S = 0.025  # short: a scheduler that frees a slot idles until the next claim arrives


class ServiceUnavailable(Exception):
    """No scheduler or detokenizer can take the request now (HTTP 503)."""


class Placement:
    def __init__(self, config: TokenizerConfig, transport: Transport) -> None:
        self.config = config
        self._transport = transport

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
