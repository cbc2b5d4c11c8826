"""A service's first connection to NATS: bounded, and clear about why it failed.

nats-py runs with unlimited reconnects (`max_reconnect_attempts=-1`) so that a NATS restart
mid-run is survived, but the same setting makes its *first* `connect` retry forever: a service
given a wrong password, or started against a server that is not there, would hang at start
without a word. So the first connect runs under our own bounds, and only the first:

- the server rejects our credentials (`Authorization Violation`): stop at once — retrying cannot
  fix a wrong password — with one line naming the server and the auth method, never the secret;
- nothing answers (refused, unreachable, TLS handshake failing): keep trying for
  `nats_start_timeout_s`, then stop with one line naming the servers and the last error.

Either way `NatsStartError` is raised; `lifecycle.run_service` turns it into that line on stderr
and a non-zero exit. Once connected, nats-py's own reconnect loop never gives up, as before.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import structlog
from nats.aio.client import Client

from services.common.connection import NatsConnection, nats_py_options

log = structlog.get_logger(__name__)

RECONNECT_WAIT_S = 0.5
CONNECT_TIMEOUT_S = 5.0
AUTH_REJECTED = "authorization violation"  # what nats-server answers to any credential it refuses


class NatsStartError(Exception):
    """The service could not make its first connection to NATS (the message is the one line shown)."""


def is_auth_rejection(error: BaseException | str) -> bool:
    return AUTH_REJECTED in str(error).lower()


def auth_rejected(connection: NatsConnection, name: str, server: str = "") -> NatsStartError:
    where = server or connection.redacted_url
    return NatsStartError(
        f"{name}: the NATS server at {where} rejected our credentials ({connection.auth_description}): "
        "Authorization Violation; check the user/password, token, nkey or .creds given to this service"
    )


def unreachable(connection: NatsConnection, name: str, last_error: str) -> NatsStartError:
    return NatsStartError(
        f"{name}: could not connect to NATS at {connection.redacted_url} within "
        f"{connection.nats_start_timeout_s:g}s (SPARKWIRE_NATS_START_TIMEOUT_S); last error: {last_error}"
    )


async def connect_nats_py(
    connection: NatsConnection, name: str, error_cb: Callable[[Exception], Awaitable[None]], **options: Any
) -> Client:
    """`nats.connect` with unlimited reconnects once connected, under the start bounds above.
    `error_cb` sees every error after the start; during it, errors are logged here once each."""
    nc = Client()
    start = _Start(connection, name)

    async def on_error(exc: Exception) -> None:
        await (start.saw(exc) if start.running else error_cb(exc))

    connecting = asyncio.ensure_future(nc.connect(
        name=name, max_reconnect_attempts=-1, reconnect_time_wait=RECONNECT_WAIT_S, connect_timeout=CONNECT_TIMEOUT_S,
        error_cb=on_error, **nats_py_options(connection), **options,
    ))  # fmt: skip
    try:
        await asyncio.wait({connecting, start.rejected}, timeout=connection.nats_start_timeout_s,
                           return_when=asyncio.FIRST_COMPLETED)  # fmt: skip
    finally:
        start.running = False
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            await nc.close()
    if connecting.done() and not connecting.cancelled() and connecting.exception() is None:
        return nc
    if start.rejected.done():
        raise auth_rejected(connection, name)
    raise unreachable(connection, name, start.last_error if connecting.cancelled() else repr(connecting.exception()))


class _Start:
    """What nats-py reported while connecting for the first time."""

    def __init__(self, connection: NatsConnection, name: str) -> None:
        self.running = True
        self.rejected: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.last_error = "none reported"
        self._connection = connection
        self._name = name

    async def saw(self, exc: Exception) -> None:
        if is_auth_rejection(exc):
            if not self.rejected.done():
                self.rejected.set_result(None)
            return
        if repr(exc) != self.last_error:  # one line per distinct error, not one per retry
            log.warning("nats.start_retrying", service=self._name, servers=self._connection.redacted_url,
                        error=repr(exc), gives_up_after_s=self._connection.nats_start_timeout_s)  # fmt: skip
        self.last_error = repr(exc)
