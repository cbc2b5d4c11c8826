"""The receiving half of a service's NATS connection, hand-written for multi-MB messages.

Why: nats-py's read path copies each payload about six times (the event loop's read buffer, the
StreamReader buffer, 32 KiB reads, the parser's buffer, two slices) and takes ~650 loop turns per
21 MB. Prompt top logprobs of a 131072 x 20 prompt (21 MB, chunked at 1 MB) cross two hops, and on
the 2-core machine that read path was the largest part of what the arrays add end to end
(`sparkwire bench logprob-transport` measures both readers in one run). Publishing, requests,
replies and reconnect logic for them stay with nats-py in `transport.Transport`.

What this is: one TCP connection that speaks the subscriber half of the NATS client protocol
(INFO, CONNECT, SUB, PING/PONG, MSG/HMSG, +OK/-ERR) through an `asyncio.BufferedProtocol`. Control
lines and small payloads are read into one reusable buffer; once a message's headers are known, its
`PayloadSink` says where the payload goes (a framed chunk: its place in the message's reassembly
buffer) and the rest of the payload is read from the socket straight into that place. It
reconnects (and re-subscribes) after the server goes away, as nats-py does.

All of a service's subscriptions live on its one reader, so messages from one publisher reach
every subscription of a service in the order they were published (what NATS guarantees per pair
of connections).

The connection (servers, TLS, auth, subscriptions, keepalive, reconnects) lives here; the
protocol's parsing, `ReadProtocol`, and what it hands over (`Delivery`) in `nats_read_protocol.py`.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import nkeys
import structlog

from services.common.connection import (
    WEBSOCKET_SCHEMES, NatsConnection, as_connection, host_and_port, redact_url, url_credentials,
)  # fmt: skip
from services.common.nats_read_protocol import CRLF, Delivery, PayloadSink, ReaderError, ReadProtocol
from services.common.nats_start import CONNECT_TIMEOUT_S, RECONNECT_WAIT_S  # the pace of nats-py's connection

log = structlog.get_logger(__name__)

# `Delivery`, `PayloadSink` and `ReaderError` are defined with the protocol that produces them
# (nats_read_protocol.py); the reader's users import them from here.
__all__ = ["Delivery", "NatsReader", "PayloadSink", "ReaderError", "ReaderEvents", "auth_options", "read_creds"]


@dataclass
class _Subscription:
    subject: str
    queue: str
    sink: PayloadSink


@dataclass
class ReaderEvents:
    """What happened to the connection (the owner counts these with its own)."""

    on_disconnect: Callable[[], None] = lambda: None
    on_reconnect: Callable[[], None] = lambda: None
    on_error: Callable[[str], None] = lambda _message: None


@dataclass
class NatsReader:
    """A subscriber-only NATS connection. `connect`, then `subscribe` sinks, `flush`, `close`.

    Servers: those of the connection, in order, then any the cluster announces (INFO
    `connect_urls`); each attempt starts after the server last lost, so a dead node is tried last.
    """

    connection: NatsConnection
    name: str
    events: ReaderEvents = field(default_factory=ReaderEvents)
    _protocol: ReadProtocol | None = None
    _subscriptions: dict[int, _Subscription] = field(default_factory=dict)
    _next_sid: int = 1
    _closing: bool = False
    _reconnecting: asyncio.Task[None] | None = None
    _keepalive: asyncio.Task[None] | None = None
    _servers: list[str] = field(default_factory=list)  # configured first, then discovered
    _server_index: int = 0  # the server in use, or the one to try first

    @staticmethod
    def unsupported(connection: NatsConnection) -> str | None:
        """Why this reader cannot speak `connection` (the owner then falls back), or None."""
        websocket = [redact_url(url) for url in connection.servers if urlsplit(url).scheme in WEBSOCKET_SCHEMES]
        return f"websocket servers ({', '.join(websocket)})" if websocket else None

    @classmethod
    async def connect(cls, connection: NatsConnection | str, name: str, events: ReaderEvents | None = None) -> NatsReader:
        connection = as_connection(connection)
        reader = cls(connection, name, events or ReaderEvents(), _servers=list(connection.servers))
        reader._protocol = await reader._open_any()
        reader._keepalive = asyncio.get_running_loop().create_task(reader._ping_forever())
        return reader

    @property
    def is_connected(self) -> bool:
        return self._protocol is not None and self._protocol.transport is not None and not self._protocol.closed.done()

    def subscribe(self, subject: str, sink: PayloadSink, queue: str = "") -> int:
        sid = self._next_sid
        self._next_sid += 1
        self._subscriptions[sid] = _Subscription(subject, queue, sink)
        if self._protocol is not None:
            self._protocol.write(_sub_line(subject, queue, sid))
        return sid

    def unsubscribe(self, sid: int) -> None:
        if self._subscriptions.pop(sid, None) is not None and self._protocol is not None:
            self._protocol.write(f"UNSUB {sid}\r\n".encode())

    async def flush(self, timeout: float = CONNECT_TIMEOUT_S) -> None:
        """Round trip to the server: every SUB written before it is in effect after it."""
        if self._protocol is None:
            raise ConnectionError("the NATS reader is not connected")
        await asyncio.wait_for(self._protocol.ping(), timeout)

    async def close(self) -> None:
        self._closing = True
        for task in (self._reconnecting, self._keepalive):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        protocol, self._protocol = self._protocol, None
        if protocol is not None and protocol.transport is not None:
            protocol.transport.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(protocol.closed, 5)

    # internals

    async def _ping_forever(self) -> None:
        """A PING every `nats_ping_interval_s`; no PONG within two intervals means the link is dead
        (a vanished host sends no FIN), so drop it and reconnect, as nats-py does on its side."""
        interval = self.connection.nats_ping_interval_s
        while not self._closing:
            await asyncio.sleep(interval)
            protocol = self._protocol
            if protocol is None or protocol.transport is None or protocol.closed.done():
                continue
            try:
                await asyncio.wait_for(protocol.ping(), 2 * interval)
            except (TimeoutError, ConnectionError, ReaderError):
                if protocol is self._protocol and protocol.transport is not None:
                    log.warning("nats_reader.no_pong", service=self.name, waited_s=2 * interval)
                    protocol.transport.abort()

    def _sink(self, sid: int) -> PayloadSink | None:
        subscription = self._subscriptions.get(sid)
        return subscription.sink if subscription is not None else None

    async def _open_any(self) -> ReadProtocol:
        """Each known server once, from `_server_index` on; the first that lets us in."""
        errors = []
        for step in range(len(self._servers)):
            index = (self._server_index + step) % len(self._servers)
            try:
                protocol = await self._open(self._servers[index])
            except (OSError, ConnectionError, ReaderError, TimeoutError) as exc:
                errors.append(f"{redact_url(self._servers[index])}: {exc!r}")
                continue
            self._server_index = index
            return protocol
        raise ReaderError("no NATS server let the reader in: " + "; ".join(errors))

    async def _open(self, url: str) -> ReadProtocol:
        """TCP, the server's INFO, TLS when either side wants it, CONNECT with our credentials,
        the subscriptions again, and a PING whose PONG says the server accepted all of it."""
        loop = asyncio.get_running_loop()
        host, port = host_and_port(url)
        transport, protocol = await asyncio.wait_for(
            loop.create_connection(lambda: ReadProtocol(self), host, port), CONNECT_TIMEOUT_S
        )
        try:
            info = await asyncio.wait_for(protocol.info, CONNECT_TIMEOUT_S)
            if self.connection.tls or info.get("tls_required"):
                await self._start_tls(protocol, host)
            options = self._connect_options(url, info)
            protocol.write(b"CONNECT " + json.dumps(options).encode() + CRLF)
            for sid, subscription in self._subscriptions.items():
                protocol.write(_sub_line(subscription.subject, subscription.queue, sid))
            await asyncio.wait_for(protocol.ping(), CONNECT_TIMEOUT_S)  # -ERR (auth) fails this PING
        except BaseException:
            (protocol.transport or transport).close()
            raise
        return protocol

    async def _start_tls(self, protocol: ReadProtocol, host: str) -> None:
        """Upgrade in place after INFO, as the protocol has it; our protocol object keeps parsing."""
        context = self.connection.ssl_context()
        if context is None:
            raise ReaderError("the server requires TLS: give --nats-tls-ca (or a tls:// URL)")
        assert protocol.transport is not None
        loop = asyncio.get_running_loop()
        protocol.transport = await asyncio.wait_for(
            loop.start_tls(protocol.transport, protocol, context, server_hostname=host), CONNECT_TIMEOUT_S
        )

    def _connect_options(self, url: str, info: dict[str, Any]) -> dict[str, Any]:
        options: dict[str, Any] = {
            "verbose": False, "pedantic": False, "tls_required": self.connection.tls, "name": self.name,
            "lang": "python3-sparkwire-reader", "version": "0.1.0", "protocol": 1, "headers": True,
            "no_responders": True,
        }  # fmt: skip
        return options | auth_options(self.connection, url, info.get("nonce"))

    def _on_info(self, info: dict[str, Any]) -> None:
        """Remember servers the cluster announces, for failover (what nats-py does too)."""
        scheme = urlsplit(self._servers[self._server_index]).scheme
        known = {host_and_port(url) for url in self._servers}
        for address in info.get("connect_urls") or ():
            url = f"{scheme}://{address}"
            if host_and_port(url) not in known:
                self._servers.append(url)
                known.add(host_and_port(url))

    def _on_server_error(self, message: str) -> None:
        log.warning("nats_reader.server_error", service=self.name, error=message)
        self.events.on_error(message)

    def _on_connection_lost(self, protocol: ReadProtocol, exc: Exception | None) -> None:
        if protocol is not self._protocol or self._closing:
            return
        log.warning("nats_reader.disconnected", service=self.name, error=repr(exc),
                    server=redact_url(self._servers[self._server_index]))  # fmt: skip
        self._server_index = (self._server_index + 1) % len(self._servers)  # the lost one is tried last
        self.events.on_disconnect()
        self._reconnecting = asyncio.get_running_loop().create_task(self._reconnect())

    async def _reconnect(self) -> None:
        self._protocol = None
        while not self._closing:
            await asyncio.sleep(RECONNECT_WAIT_S)
            try:
                self._protocol = await self._open_any()
            except (OSError, ConnectionError, ReaderError, TimeoutError) as exc:
                log.debug("nats_reader.reconnect_failed", service=self.name, error=repr(exc))
                continue
            log.info("nats_reader.reconnected", service=self.name)
            self.events.on_reconnect()
            return


def auth_options(connection: NatsConnection, url: str, nonce: str | None) -> dict[str, str]:
    """The CONNECT fields of the connection's one auth method (see `NatsConnection.auth_method`)."""
    method = connection.auth_method
    if method in ("creds", "nkey"):
        if nonce is None:
            raise ReaderError("nkey/creds auth configured but the server sent no nonce to sign")
        jwt, seed = read_creds(Path(connection.nats_creds)) if method == "creds" else (None, Path(connection.nats_nkey_seed).read_bytes().strip())
        key_pair = nkeys.from_seed(bytearray(seed))
        signed = {"sig": base64.b64encode(key_pair.sign(nonce.encode())).decode()}
        return signed | ({"jwt": jwt} if jwt else {"nkey": key_pair.public_key.decode()})
    if method == "token":
        return {"auth_token": connection.nats_token}
    if method == "user":
        return {"user": connection.nats_user, "pass": connection.nats_password}
    credentials = url_credentials(url)
    if credentials is None:
        return {}
    user, password = credentials
    return {"auth_token": user} if password is None else {"user": user, "pass": password}  # nats://token@host


def read_creds(path: Path) -> tuple[str, bytes]:
    """(user JWT, nkey seed) from a .creds file: each is the line after its BEGIN marker."""
    lines = path.read_bytes().splitlines()
    after = {marker: next(line.strip() for line in lines[i + 1 :] if line.strip())
             for i, line in enumerate(lines) for marker in (b"USER JWT", b"NKEY SEED")
             if line.startswith(b"-----BEGIN") and marker in line}  # fmt: skip
    if set(after) != {b"USER JWT", b"NKEY SEED"}:
        raise ReaderError(f"{path}: not a .creds file (needs a user JWT and an nkey seed)")
    return after[b"USER JWT"].decode(), after[b"NKEY SEED"]


def _sub_line(subject: str, queue: str, sid: int) -> bytes:
    return (f"SUB {subject} {queue} {sid}\r\n" if queue else f"SUB {subject} {sid}\r\n").encode()
