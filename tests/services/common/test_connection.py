"""The one connection config: flags and environment derived from its fields, secrets kept out of
argv and logs, and every auth method, TLS and server lists working on both of a service's
connections (nats-py's and the hand-written reader), against real nats-servers."""

from __future__ import annotations

import argparse
import asyncio
import base64
import os
from pathlib import Path

import msgspec
import nkeys
import pytest
from structlog.testing import capture_logs

from contracts.control import Heartbeat
from services.common.connection import (
    SECRET_FIELDS,
    NatsConnection,
    add_connection_arguments,
    connection_from_args,
    nats_py_options,
    redact_url,
)
from services.common.lifecycle import run_event_loop
from services.common.nats_reader import NatsReader, ReaderEvents, auth_options, read_creds
from services.common.nats_server import free_port
from services.common.natspy_reader import NatsPyReader
from services.common.settings import connection_environ, connection_from_environ, connection_values
from services.common.transport import Transport
from tls_certs import make_tls_files

BIG = 600 * 1024  # over FRAMED_MIN_BYTES: travels framed, read straight into its buffer by the reader


class Payload(msgspec.Struct):
    data: bytes


# ---- the config itself ----


def parse(argv: list[str], environ: dict[str, str]) -> NatsConnection:
    parser = argparse.ArgumentParser()
    values = connection_values(environ)
    add_connection_arguments(parser, values)
    return connection_from_args(parser.parse_args(argv), values)


def test_every_field_but_the_secrets_has_a_flag_and_every_field_a_variable():
    parser = argparse.ArgumentParser()
    add_connection_arguments(parser, {})
    flags = {action.dest for action in parser._actions if action.option_strings and action.dest != "help"}
    assert flags == set(NatsConnection.__struct_fields__) - SECRET_FIELDS
    every = {name: ("x" if name in ("nats_user", "nats_password") else getattr(NatsConnection(), name)) for name in NatsConnection.__struct_fields__}
    environ = {f"SPARKWIRE_{name.upper()}": str(value) for name, value in every.items() if name != "nats_token"}
    assert set(connection_values(environ)) == set(NatsConnection.__struct_fields__) - {"nats_token"}


def test_flags_win_over_the_environment_and_secrets_come_only_from_it():
    environ = {"SPARKWIRE_NATS_URL": "nats://env:1", "SPARKWIRE_NATS_USER": "svc", "SPARKWIRE_NATS_PASSWORD": "pw",
               "SPARKWIRE_HEARTBEAT_INTERVAL_S": "0.3"}  # fmt: skip
    connection = parse(["--nats-url", "tls://a:1, tls://b:2", "--drain-timeout-s", "3"], environ)
    assert connection.servers == ("tls://a:1", "tls://b:2") and connection.tls
    assert (connection.nats_user, connection.nats_password, connection.heartbeat_interval_s) == ("svc", "pw", 0.3)
    assert connection.drain_timeout_s == 3.0
    with pytest.raises(SystemExit):
        parse(["--nats-password", "pw"], {})
    assert connection_from_environ(connection_environ(connection)) == connection


def test_secrets_never_show_in_repr_or_redacted_urls():
    connection = NatsConnection(nats_url="nats://u:hunter2@h:1,nats://tok3n@h:2", nats_user="u", nats_password="hunter2")
    shown = f"{connection!r} {connection.redacted_url}"
    assert "hunter2" not in shown and "tok3n" not in shown and "h:1" in shown
    assert redact_url("nats://h:4222") == "nats://h:4222"


@pytest.mark.parametrize(
    "values, error",
    [
        ({"nats_user": "a", "nats_token": "t"}, "one NATS auth method"),
        ({"nats_password": "p"}, "needs a user"),
        ({"nats_tls_cert": __file__}, "go together"),
        ({"nats_creds": "/no/such.creds"}, "not found"),
        ({"nats_url": "http://h:1"}, "scheme"),
        ({"heartbeat_interval_s": 3.0}, "heartbeat"),
    ],
)
def test_impossible_connections_are_refused_with_a_reason(values, error):
    with pytest.raises((ValueError, msgspec.ValidationError), match=error):
        msgspec.convert(values, NatsConnection)


def test_creds_and_nkey_auth_sign_the_servers_nonce(tmp_path):
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    creds = tmp_path / "svc.creds"
    creds.write_text(f"-----BEGIN NATS USER JWT-----\neyJ0eXAi.fake.jwt\n------END NATS USER JWT------\n\n"
                     f"-----BEGIN USER NKEY SEED-----\n{seed.decode()}\n------END USER NKEY SEED------\n")  # fmt: skip
    assert read_creds(creds) == ("eyJ0eXAi.fake.jwt", seed)
    options = auth_options(NatsConnection(nats_creds=str(creds)), "nats://h:1", "n0nce")
    public = nkeys.from_seed(bytearray(seed))
    assert options["jwt"] == "eyJ0eXAi.fake.jwt" and public.verify(b"n0nce", base64.b64decode(options["sig"]))
    assert nats_py_options(NatsConnection(nats_creds=str(creds)))["user_credentials"] == str(creds)


def test_a_token_in_the_url_is_sent_as_a_token_not_as_a_user():
    assert auth_options(NatsConnection(), "nats://s3cret@h:1", None) == {"auth_token": "s3cret"}
    assert auth_options(NatsConnection(), "nats://u:p@h:1", None) == {"user": "u", "pass": "p"}


# ---- against real servers: both connections of a Transport ----


async def round_trip(connection: NatsConnection) -> list[int]:
    """A small and a framed message from one Transport to another's subscription (its reader)."""
    sender, receiver = await Transport.connect(connection, "sender"), await Transport.connect(connection, "receiver")
    got: asyncio.Queue[int] = asyncio.Queue()

    async def handler(message: Payload, _delivery: object) -> None:
        await got.put(len(message.data))

    try:
        await receiver.subscribe("test.auth", Payload, handler)
        await receiver.flush()
        for size in (10, BIG):
            await sender.publish("test.auth", Payload(os.urandom(size)))
        return [await asyncio.wait_for(got.get(), 10) for _ in range(2)]
    finally:
        await sender.close()
        await receiver.close()


def user_nkey() -> tuple[bytes, str]:
    seed = nkeys.encode_seed(os.urandom(32), nkeys.PREFIX_BYTE_USER)
    return seed, nkeys.from_seed(bytearray(seed)).public_key.decode()


@pytest.mark.parametrize("method", ["token", "token-in-url", "user", "nkey"])
def test_each_auth_method_gets_both_connections_in_and_a_wrong_secret_does_not(nats_server_factory, tmp_path, method):
    seed, public = user_nkey()
    seed_file = tmp_path / "svc.nk"
    seed_file.write_bytes(seed)
    authorization = {
        "token": "{ token: s3cret }", "token-in-url": "{ token: s3cret }",
        "user": "{ users: [ { user: svc, password: pw } ] }", "nkey": f"{{ users: [ {{ nkey: {public} }} ] }}",
    }[method]  # fmt: skip
    server = nats_server_factory(authorization=authorization)
    port = server.port
    good, bad = {
        "token": (NatsConnection(nats_url=server.url, nats_token="s3cret"), NatsConnection(nats_url=server.url, nats_token="nope")),
        "token-in-url": (NatsConnection(nats_url=f"nats://s3cret@127.0.0.1:{port}"), NatsConnection(nats_url=f"nats://x@127.0.0.1:{port}")),
        "user": (NatsConnection(nats_url=server.url, nats_user="svc", nats_password="pw"),
                 NatsConnection(nats_url=server.url, nats_user="svc", nats_password="no")),
        "nkey": (NatsConnection(nats_url=server.url, nats_nkey_seed=str(seed_file)), None),
    }[method]  # fmt: skip
    assert run_event_loop(round_trip(good), "uvloop") == [10, BIG]
    if bad is not None:
        with pytest.raises(Exception, match="(?i)authorization|violation|lost"):
            run_event_loop(NatsReader.connect(bad, "reader"), "uvloop")


@pytest.mark.parametrize("loop", ["uvloop", "asyncio"])
def test_mutual_tls_carries_small_and_framed_messages_through_the_reader(nats_server_factory, tmp_path, loop):
    tls = make_tls_files(tmp_path / "tls")
    server = nats_server_factory(
        tls=f"{{ cert_file: '{tls.server_cert}', key_file: '{tls.server_key}', ca_file: '{tls.ca}', verify: true }}",
        authorization="{ token: s3cret }",
    )
    connection = NatsConnection(nats_url=f"tls://127.0.0.1:{server.port}", nats_tls_ca=str(tls.ca),
                                nats_tls_cert=str(tls.client_cert), nats_tls_key=str(tls.client_key), nats_token="s3cret")  # fmt: skip
    assert run_event_loop(round_trip(connection), loop) == [10, BIG]
    without_certificate = msgspec.structs.replace(connection, nats_tls_cert="", nats_tls_key="")
    with pytest.raises(Exception):
        run_event_loop(NatsReader.connect(without_certificate, "reader"), loop)


def test_a_server_list_skips_a_dead_server_on_both_connections(nats_server):
    dead = f"nats://127.0.0.1:{free_port()}"
    connection = NatsConnection(nats_url=f"{dead},{nats_server.url}")
    assert run_event_loop(round_trip(connection), "uvloop") == [10, BIG]


def test_a_websocket_server_falls_back_to_a_nats_py_subscription_and_says_so_once(nats_server_factory):
    port = free_port()
    server = nats_server_factory(websocket=f"{{ port: {port}, no_tls: true }}")
    connection = NatsConnection(nats_url=f"ws://127.0.0.1:{port}")
    assert NatsReader.unsupported(connection) and NatsReader.unsupported(NatsConnection(nats_url=server.url)) is None

    async def scenario() -> tuple[list[int], bool]:
        transport = await Transport.connect(connection, "ws-client")
        fell_back = isinstance(transport._reader, NatsPyReader)
        await transport.close()
        return await round_trip(connection), fell_back

    with capture_logs() as logs:
        sizes, fell_back = run_event_loop(scenario(), "uvloop")
    assert fell_back and sizes == [10, BIG]
    warnings = [entry for entry in logs if entry["event"] == "transport.reader_fallback"]
    assert [entry["service"] for entry in warnings] == ["ws-client", "sender", "receiver"]  # once per connection
    assert "websocket" in warnings[0]["reason"]


def test_tls_is_on_exactly_when_configured(tmp_path: Path):
    tls = make_tls_files(tmp_path / "tls")
    connection = NatsConnection(nats_tls_ca=str(tls.ca))
    assert connection.tls and connection.ssl_context() is not None
    assert NatsConnection().ssl_context() is None


def test_the_reader_drops_a_link_whose_server_stopped_answering_and_reconnects():
    """A server that goes silent (no FIN: a vanished host) is noticed by the reader's own PINGs."""

    async def scenario() -> tuple[int, int]:
        connections: list[asyncio.StreamWriter] = []

        async def silent_after_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            connections.append(writer)
            writer.write(b'INFO {"server_id":"fake","headers":true,"max_payload":1048576}\r\n')
            while line := await reader.readline():
                if line.startswith(b"PING") and len(connections) == 1 and not getattr(writer, "answered", False):
                    writer.answered = True  # type: ignore[attr-defined]
                    writer.write(b"PONG\r\n")  # the connect handshake's PING only; then silence
                elif line.startswith(b"PING") and len(connections) > 1:
                    writer.write(b"PONG\r\n")

        server = await asyncio.start_server(silent_after_connect, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        counts = {"down": 0, "up": 0}
        events = ReaderEvents(on_disconnect=lambda: counts.__setitem__("down", counts["down"] + 1),
                              on_reconnect=lambda: counts.__setitem__("up", counts["up"] + 1))  # fmt: skip
        reader = await NatsReader.connect(NatsConnection(nats_url=f"nats://127.0.0.1:{port}", nats_ping_interval_s=0.2), "r", events)
        for _ in range(50):
            if counts["up"]:
                break
            await asyncio.sleep(0.05)
        await reader.close()
        server.close()
        return counts["down"], counts["up"]

    assert run_event_loop(scenario(), "uvloop") == (1, 1)
