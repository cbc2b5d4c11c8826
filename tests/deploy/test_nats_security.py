"""The secured nats-server config (ops/nats/secured.conf, what `sparkwire up` embeds): nobody gets
in without an identity, and each identity may speak only on its own subjects, so heartbeats and
control messages come only from the service kind allowed to send them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import nats
import pytest

from contracts import subjects
from contracts.control import Heartbeat
from services.common.connection import NatsConnection
from services.common.lifecycle import run_event_loop
from services.common.nats_auth import PERMISSIONS, draw_passwords, render_authorization, server_environ
from services.common.nats_reader import NatsReader
from services.common.nats_server import PROJECT_CONFIG, SECURED_CONFIG, NatsServer, start_nats_server
from services.common.transport import Transport


@pytest.fixture
def secured() -> Iterator[tuple[NatsServer, dict[str, str]]]:
    passwords = draw_passwords()
    server = start_nats_server(SECURED_CONFIG, env=server_environ(passwords))
    yield server, passwords
    server.stop()


def identity(server: NatsServer, passwords: dict[str, str], name: str) -> NatsConnection:
    return NatsConnection(nats_url=server.url, nats_user=name, nats_password=passwords[name])


def test_the_committed_auth_conf_is_rendered_from_the_permissions_table():
    committed = (PROJECT_CONFIG.parent / "auth.conf").read_text()
    assert committed == render_authorization(), "regenerate ops/nats/auth.conf from nats_auth.render_authorization()"
    assert set(PERMISSIONS) >= {"tokenizer", "detokenizer", "scheduler"}


def test_no_identity_no_entry_and_a_wrong_password_neither(secured):
    server, passwords = secured
    for user, password in ((None, None), ("scheduler", "guess")):
        with pytest.raises(Exception, match="(?i)authorization|lost"):  # the reader: -ERR fails its PING
            run_event_loop(NatsReader.connect(NatsConnection(nats_url=server.url, nats_user=user or "", nats_password=password or ""), "intruder"), "uvloop")
        with pytest.raises(Exception, match="(?i)authorization|no servers"):
            run_event_loop(nats.connect(server.url, user=user, password=password, allow_reconnect=False), "uvloop")


def test_only_a_scheduler_can_declare_a_scheduler_dead(secured):
    """A tokenizer's forged "dead" scheduler heartbeat is refused by the server; the real one arrives."""
    server, passwords = secured

    async def scenario() -> list[Heartbeat]:
        watcher = await Transport.connect(identity(server, passwords, "detokenizer"), "watcher")
        forger = await Transport.connect(identity(server, passwords, "tokenizer"), "forger")
        scheduler = await Transport.connect(identity(server, passwords, "scheduler"), "scheduler")
        seen: list[Heartbeat] = []

        async def on_beat(beat: Heartbeat, _delivery: object) -> None:
            seen.append(beat)

        await watcher.subscribe(subjects.heartbeat("scheduler"), Heartbeat, on_beat)
        await watcher.flush()
        await forger.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", "forged", alive=False))
        await forger.flush()
        await scheduler.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", "real", alive=False))
        await scheduler.flush()
        await asyncio.sleep(0.3)
        assert any("permissions violation" in error.lower() for error in forger.events.errors), forger.events.errors
        for transport in (watcher, forger, scheduler):
            await transport.close()
        return seen

    assert [beat.instance_id for beat in run_event_loop(scenario(), "uvloop")] == ["real"]


@pytest.mark.parametrize("name", ["tokenizer", "detokenizer", "scheduler"])
def test_a_service_cannot_read_what_is_not_meant_for_it(secured, name):
    """E.g. a tokenizer subscribing to every token batch is refused (prompts and outputs stay private)."""
    server, passwords = secured
    foreign = {"tokenizer": subjects.detokenizer_tokens("*"), "detokenizer": subjects.scheduler_generate("*"),
               "scheduler": subjects.tokenizer_outputs("*")}[name]  # fmt: skip

    async def scenario() -> list[str]:
        errors: list[str] = []

        async def on_error(exc: Exception) -> None:
            errors.append(repr(exc))

        nc = await nats.connect(server.url, user=name, password=passwords[name], error_cb=on_error)
        await nc.subscribe(foreign)
        await nc.flush()
        await asyncio.sleep(0.2)
        await nc.close()
        return errors

    assert any("permissions violation" in error.lower() for error in run_event_loop(scenario(), "uvloop"))
