"""A scripted stand-in for the scheduler and the detokenizer, written from `contracts/` only, so
the tokenizer service is tested alone over a real nats-server and its real HTTP port."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

import msgspec
import numpy as np
import pytest

from contracts.weights import Control, ControlReply
from contracts import subjects
from contracts.control import Heartbeat
from contracts.detokenizer import (
    DetokenizerRegistration,
    DetokenizerRegistrationReply,
    Finish,
    FinishType,
)
from contracts.scheduler import (
    AbortRequest,
    GenerateRequest,
    SchedulerClaim,
    SchedulerClaimReply,
    SchedulerInfo,
    SchedulerPing,
)
from contracts.tokenizer import TextBatch
from services.common.arrays import from_wire, to_wire
from services.common.logprob_rows import RequestLogprobs
from tests.logprob_entries import batch_columns, logprobs_of
from services.common.connection import NatsConnection
from services.common.lifecycle import wait_until
from services.common.nats_server import free_port
from services.common.transport import Transport
from services.models import RANDOM_TINY_MODEL
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.http_app import Frontend
from services.tokenizer.server import serving
from services.tokenizer.text_model import TextModel

MODEL_DIR = RANDOM_TINY_MODEL
REPLY_TEXT = "Hello world, this is a reply."
SCHEDULER_ID = "sched-1"
DETOKENIZER_ID = "detok-1"


@pytest.fixture(scope="session")
def text_model() -> TextModel:
    return TextModel.from_dir(MODEL_DIR)


def fake_logprob(position: int, token_id: int) -> float:
    """Deterministic, distinct per (position, token) so tests can recompute them."""
    return -((position * 7 + token_id) % 97) / 10.0 - 0.05


def top_ids(position: int, k: int) -> list[int]:
    return [(position * 13 + j * 5) % 2000 + 3 for j in range(k)]


def scripted_logprobs(request: GenerateRequest, positions: list[int], prompt_len: int, first: bool) -> RequestLogprobs | None:
    """Output entries for `positions` (output indices); prompt entries in the first message."""
    params = request.logprobs
    if not params.return_logprob:
        return None
    k, m = params.top_logprobs_num, len(params.token_ids_logprob)
    fields = {"output_token_logprobs": to_wire(np.array([fake_logprob(prompt_len + p, 0) for p in positions], "<f4"))}
    if k:
        fields["output_top_logprobs"] = to_wire(_top_values(positions, k, prompt_len))
        fields["output_top_ids"] = to_wire(np.array([top_ids(prompt_len + p, k) for p in positions], "<i4").reshape(-1, k))
    if m:
        vals = [[fake_logprob(prompt_len + p, t) for t in params.token_ids_logprob] for p in positions]
        fields["output_ids_logprobs"] = to_wire(np.array(vals, "<f4").reshape(-1, m))
    if first and params.logprob_start_len >= 0:
        fields.update(_input_fields(request, prompt_len))
    return logprobs_of(**fields)


def _top_values(positions: list[int], k: int, offset: int) -> np.ndarray:
    return np.array([[-0.1 * (j + 1) - (offset + p) * 0.001 for j in range(k)] for p in positions], "<f4").reshape(-1, k)


def _input_fields(request: GenerateRequest, prompt_len: int) -> dict:
    params = request.logprobs
    start, k, m = params.logprob_start_len, params.top_logprobs_num, len(params.token_ids_logprob)
    positions = list(range(start, prompt_len))
    values = np.array([fake_logprob(p, 0) for p in positions], "<f4")
    if start == 0:
        values[0] = np.nan
    fields = {"input_start": start, "input_token_logprobs": to_wire(values)}
    if k:
        top_v = _top_values(positions, k, 0)
        top_i = np.array([top_ids(p, k) for p in positions], "<i4").reshape(-1, k)
        if start == 0:
            top_v[0], top_i[0] = np.nan, -1
        if params.flat_prompt_top_logprobs:
            prefix = 1 if start == 0 else 0
            fields |= {"input_top_logprobs_flat": to_wire(top_v[prefix:]), "input_top_ids_flat": to_wire(top_i[prefix:])}
            fields["input_top_null_prefix"] = prefix
        else:
            fields |= {"input_top_logprobs": to_wire(top_v), "input_top_ids": to_wire(top_i)}
    if m:
        vals = np.array([[fake_logprob(p, t) for t in params.token_ids_logprob] for p in positions], "<f4").reshape(-1, m)
        if start == 0:
            vals[0] = np.nan
        fields["input_ids_logprobs"] = to_wire(vals)
    return fields


@dataclass
class FakeBackend:
    """Answers claims and registrations, and plays a reply of `REPLY_TEXT` tokens in steps."""

    transport: Transport
    model: TextModel
    tokens_per_step: int = 2
    step_delay_s: float = 0.01
    hang: bool = False  # accept requests but never answer them
    claim_error: str | None = None
    forks: bool = False  # answer claims as a scheduler that forks n > 1 choices (else as an older one)
    claims: list[SchedulerClaim] = field(default_factory=list)
    registrations: list[DetokenizerRegistration] = field(default_factory=list)
    requests: list[GenerateRequest] = field(default_factory=list)
    aborts: list[AbortRequest] = field(default_factory=list)
    request_headers: list[dict[str, str] | None] = field(default_factory=list)  # NATS headers per GenerateRequest
    beating: asyncio.Task[None] | None = None
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    async def start(self, answer_pings: bool = True) -> None:
        t = self.transport
        await t.subscribe(subjects.DETOKENIZER_REGISTER, DetokenizerRegistration, self._on_register, queue="detokenizer")
        await t.subscribe(subjects.SCHEDULER_CLAIM, SchedulerClaim, self._on_claim, queue="scheduler")
        await t.subscribe(subjects.scheduler_generate(SCHEDULER_ID), GenerateRequest, self._on_generate)
        await t.subscribe(subjects.SCHEDULER_ABORT, AbortRequest, self._on_abort)
        await t.subscribe(subjects.scheduler_control(SCHEDULER_ID), Control, self._on_control)
        if answer_pings:
            await t.subscribe(subjects.SCHEDULER_PING, SchedulerPing, self._on_ping, queue="scheduler")
        await t.flush()
        self.beating = asyncio.create_task(self._beat())

    async def _beat(self) -> None:
        while True:
            await self.transport.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", SCHEDULER_ID))
            await self.transport.publish(subjects.heartbeat("detokenizer"), Heartbeat("detokenizer", DETOKENIZER_ID))
            await asyncio.sleep(0.1)

    async def go_silent(self) -> None:
        if self.beating is not None:
            self.beating.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.beating

    async def die(self) -> None:
        await self.go_silent()
        await self.transport.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", SCHEDULER_ID, alive=False, reason="boom"))

    async def _on_register(self, msg: DetokenizerRegistration, raw) -> None:
        self.registrations.append(msg)
        await self.transport.respond(raw, DetokenizerRegistrationReply(DETOKENIZER_ID))

    async def _on_claim(self, msg: SchedulerClaim, raw) -> None:
        self.claims.append(msg)
        accepted = self.claim_error is None
        await self.transport.respond(raw, SchedulerClaimReply(SCHEDULER_ID, accepted, self.claim_error, forks=self.forks))

    async def _on_ping(self, msg: SchedulerPing, raw) -> None:
        await self.transport.respond(raw, SchedulerInfo(SCHEDULER_ID, "sparkwire-tiny", 32768, 2048))

    async def _on_control(self, msg: Control, raw) -> None:
        """RL controls: done at once (the stand-in has no weights)."""
        await self.transport.respond(raw, ControlReply(SCHEDULER_ID, weight_version="0"))

    async def _on_abort(self, msg: AbortRequest, _raw) -> None:
        self.aborts.append(msg)

    async def _on_generate(self, request: GenerateRequest, raw) -> None:
        self.requests.append(request)
        self.request_headers.append(raw.headers)
        if self.hang:
            return
        choices = [msgspec.structs.replace(request, rid=c.rid, detokenizer_id=c.detokenizer_id, choices=())
                   for c in request.choices]  # fmt: skip
        for each in [request, *choices]:
            task = asyncio.create_task(self._play(each))
            self.tasks.add(task)
            task.add_done_callback(self.tasks.discard)

    def _owner(self, rid: str) -> str:
        return next(r.tokenizer_id for r in self.registrations if r.rid == rid)

    async def _play(self, request: GenerateRequest) -> None:
        reply = self.model.encode(REPLY_TEXT)[: request.sampling.max_new_tokens]
        prompt_len = from_wire(request.input_ids).shape[0]
        steps = [reply[i : i + self.tokens_per_step] for i in range(0, len(reply), self.tokens_per_step)] or [[]]
        done = 0
        for index, ids in enumerate(steps):
            last = index == len(steps) - 1
            if any(a.rid == request.rid for a in self.aborts):
                return
            finish = Finish(FinishType.LENGTH) if last else None
            lp = scripted_logprobs(request, list(range(done, done + len(ids))), prompt_len, index == 0)
            batch = TextBatch(
                DETOKENIZER_ID, SCHEDULER_ID, [request.rid], [self.model.decode(ids)],
                to_wire(np.array([len(ids)], "<i4")), to_wire(np.array(ids, "<i4")),
                to_wire(np.array([prompt_len], "<i4")), [finish], **batch_columns([lp]),
            )
            await self.transport.publish(subjects.tokenizer_outputs(self._owner(request.rid)), batch)
            done += len(ids)
            await asyncio.sleep(self.step_delay_s)


@pytest.fixture
async def backend(nats_server, text_model) -> AsyncIterator[FakeBackend]:
    transport = await Transport.connect(nats_server.url, "fake-backend")
    fake = FakeBackend(transport, text_model)
    await fake.start()
    yield fake
    await fake.go_silent()
    for task in list(fake.tasks):
        task.cancel()
    await transport.close()


def tokenizer_config(nats_url: str, **overrides) -> TokenizerConfig:
    values = dict(
        model_dir=MODEL_DIR,
        nats=NatsConnection(nats_url=nats_url, heartbeat_interval_s=0.2, heartbeat_timeout_s=1.0),
        instance_id="tok-test",
        port=free_port(),
        request_timeout_s=2.0,
        log_level="warning",
    )
    return TokenizerConfig(**(values | overrides))


@pytest.fixture
def start_tokenizer(nats_server) -> Callable[..., contextlib.AbstractAsyncContextManager[Frontend]]:
    def start(**overrides) -> contextlib.AbstractAsyncContextManager[Frontend]:
        return serving(tokenizer_config(nats_server.url, **overrides))

    return start


async def wait_live(frontend: Frontend) -> None:
    """/health wants a live scheduler and detokenizer: wait for the backend's first heartbeats."""
    assert await wait_until(lambda: all(frontend.service.liveness().values()), 10.0), frontend.service.liveness()


@pytest.fixture
async def tokenizer(start_tokenizer, backend) -> AsyncIterator[Frontend]:
    async with start_tokenizer() as frontend:
        await wait_live(frontend)
        yield frontend


def base_url(frontend: Frontend) -> str:
    return f"http://{frontend.config.host}:{frontend.config.port}"


@pytest.fixture
def url(tokenizer: Frontend) -> str:
    return base_url(tokenizer)
