"""A service's first NATS connection is bounded (services/common/nats_start.py): rejected
credentials fail at once, an absent server after `nats_start_timeout_s`, each with one line
that names the server and never a secret; reconnects after a successful start never give up.

The rejection tests give a start timeout far longer than pytest's: only the rejection can end
them in time, so a start that retried a wrong password would fail them (by pytest's timeout)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import msgspec
import nkeys
import pytest

from services.common.connection import NatsConnection
from services.common.lifecycle import run_event_loop
from services.common.nats_auth import draw_passwords, server_environ
from services.common.nats_server import SECURED_CONFIG, free_port, start_nats_server
from services.common.nats_start import NatsStartError
from services.common.transport import Transport

NEVER_S = 3600.0  # a start timeout no test waits for
SECRET = "s3cret-never-shown"


class Note(msgspec.Struct):
    text: str


def user_seed(tmp_path: Path, name: str) -> tuple[Path, str]:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    path = tmp_path / f"{name}.nk"
    path.write_bytes(seed)
    return path, nkeys.from_seed(bytearray(seed)).public_key.decode()


def wrong_connection(method: str, url: str, port: int, tmp_path: Path) -> tuple[NatsConnection, str]:
    """(a connection whose credentials the server refuses, the auth method's words in the error)."""
    stranger, _ = user_seed(tmp_path, "stranger")  # a valid seed the server does not know
    creds = tmp_path / "stranger.creds"
    creds.write_text("-----BEGIN NATS USER JWT-----\neyJ0eXAi.fake.jwt\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{stranger.read_text()}\n------END USER NKEY SEED------\n")  # fmt: skip
    timing = {"nats_start_timeout_s": NEVER_S}
    return {
        "user": (NatsConnection(nats_url=url, nats_user="svc", nats_password=SECRET, **timing), "user 'svc'"),
        "token": (NatsConnection(nats_url=url, nats_token=SECRET, **timing), "a token"),
        "token-in-url": (NatsConnection(nats_url=f"nats://{SECRET}@127.0.0.1:{port}", **timing), "in the server URL"),
        "nkey": (NatsConnection(nats_url=url, nats_nkey_seed=str(stranger), **timing), "nkey seed file"),
        "creds": (NatsConnection(nats_url=url, nats_creds=str(creds), **timing), "creds file"),
        "none": (NatsConnection(nats_url=url, **timing), "no credentials"),
    }[method]  # fmt: skip


@pytest.mark.parametrize("method", ["user", "token", "token-in-url", "nkey", "creds", "none"])
def test_rejected_credentials_fail_the_start_at_once_naming_server_and_method(nats_server_factory, tmp_path, method):
    _, known = user_seed(tmp_path, "known")
    token_server = method in ("token", "token-in-url")
    users = f"{{ users: [ {{ user: svc, password: right }}, {{ nkey: {known} }} ] }}"
    server = nats_server_factory(authorization="{ token: right }" if token_server else users)
    connection, method_words = wrong_connection(method, server.url, server.port, tmp_path)
    with pytest.raises(NatsStartError) as caught:
        run_event_loop(Transport.connect(connection, "svc-1"), "uvloop")
    line = str(caught.value)
    assert "\n" not in line and SECRET not in line
    assert "svc-1" in line and "rejected our credentials" in line and method_words in line
    assert f"127.0.0.1:{server.port}" in line


def test_an_absent_server_fails_the_start_after_the_configured_time():
    url = f"nats://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(NatsStartError, match=r"could not connect to NATS at .* within 0\.5s.*last error: .*Refused"):
        run_event_loop(Transport.connect(NatsConnection(nats_url=url, nats_start_timeout_s=0.5), "svc-1"), "uvloop")


def test_the_start_waits_for_a_server_that_comes_up_within_the_time():
    port = free_port()

    async def scenario() -> bool:
        connecting = asyncio.ensure_future(Transport.connect(NatsConnection(nats_url=f"nats://127.0.0.1:{port}"), "svc"))
        await asyncio.sleep(1.0)  # a few refused attempts first
        server = await asyncio.to_thread(start_nats_server, port=port)
        try:
            transport = await connecting
            connected = transport.is_connected
            await transport.close()
            return connected
        finally:
            server.stop()

    assert run_event_loop(scenario(), "uvloop")


def test_after_the_start_reconnects_outlast_the_start_timeout():
    """A NATS outage ten times the start timeout, after a good start: both connections come back."""
    port = free_port()
    server = start_nats_server(port=port)
    got: list[str] = []

    async def scenario() -> None:
        connection = NatsConnection(nats_url=server.url, nats_start_timeout_s=0.2)
        transport = await Transport.connect(connection, "svc")

        async def handler(note: Note, _delivery: object) -> None:
            got.append(note.text)

        await transport.subscribe("test.start", Note, handler)
        await asyncio.to_thread(server.stop)
        await asyncio.sleep(2.0)
        restarted = await asyncio.to_thread(start_nats_server, port=port)
        try:
            while not transport.is_connected:
                await asyncio.sleep(0.05)
            await transport.flush()
            await transport.publish("test.start", Note("after the outage"))
            while not got:
                await asyncio.sleep(0.05)
            await transport.close()
        finally:
            restarted.stop()

    run_event_loop(scenario(), "uvloop")
    assert got == ["after the outage"]


# ---- the service CLI: one line on stderr, a non-zero exit ----


def run_detokenizer(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "services.cli", "detokenizer", *args]
    return subprocess.run(command, env={**os.environ, **env}, capture_output=True, text=True, timeout=90)


def test_the_cli_exits_with_one_line_on_a_wrong_password():
    passwords = draw_passwords()
    server = start_nats_server(SECURED_CONFIG, env=server_environ(passwords))
    try:
        done = run_detokenizer(["--nats-url", server.url, "--nats-user", "detokenizer"],
                               {"SPARKWIRE_NATS_PASSWORD": SECRET, "SPARKWIRE_NATS_START_TIMEOUT_S": str(NEVER_S)})  # fmt: skip
    finally:
        server.stop()
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("sparkwire: detokenizer-") and "rejected our credentials (user 'detokenizer'" in last
    assert server.url in last
    assert SECRET not in done.stderr + done.stdout and passwords["detokenizer"] not in done.stderr + done.stdout


def test_the_cli_exits_after_the_start_timeout_when_no_server_answers():
    url = f"nats://127.0.0.1:{free_port()}"
    done = run_detokenizer(["--nats-url", url, "--nats-start-timeout-s", "1"], {})
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert "could not connect to NATS at " + url + " within 1s" in last
