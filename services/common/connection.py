"""How a service reaches NATS: one `NatsConnection`, the same struct for the tokenizer, scheduler,
detokenizer and `sparkwire up`.

Everything about a connection is derived from the struct's fields, once: the command-line flags
(`add_connection_arguments`: `--nats-url`, `--nats-tls-ca`, ..., `--heartbeat-interval-s`), the
`SPARKWIRE_<FIELD>` environment variables (services/common/settings.py), the nats-py options
(`nats_py_options`) and what `sparkwire up` hands its children (the environment, never argv).

Secrets (`nats_password`, `nats_token`) have no flag: a command line is visible to every user of
the machine (`ps`). They come from the environment, or live in files (`nats_nkey_seed`,
`nats_creds`, a TLS key), and are redacted wherever a connection is printed or logged.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

import msgspec

from services.common.logging import REDACTED  # one mask for every secret shown

DEFAULT_URL = "nats://127.0.0.1:4222"
SECRET_FIELDS = frozenset({"nats_password", "nats_token"})
FILE_FIELDS = ("nats_tls_ca", "nats_tls_cert", "nats_tls_key", "nats_nkey_seed", "nats_creds")
TLS_SCHEMES = ("tls", "wss")
PLAIN_SCHEMES = ("nats", "tcp", "ws")
WEBSOCKET_SCHEMES = ("ws", "wss")  # nats-py speaks them (with aiohttp installed); NatsReader does not

HELP = {
    "nats_url": "NATS server URL, or a comma-separated list (tried in order: failover); nats://, tls://, ws://, wss://",
    "nats_tls_ca": "CA bundle (PEM) that signed the servers' certificates; turns TLS on",
    "nats_tls_cert": "client certificate (PEM) for mutual TLS; turns TLS on",
    "nats_tls_key": "the client certificate's private key (PEM file)",
    "nats_user": "user name (the password only from SPARKWIRE_NATS_PASSWORD)",
    "nats_nkey_seed": "file holding this service's nkey seed (SU...)",
    "nats_creds": "a .creds file (user JWT + nkey seed), as `nsc` writes it",
    "nats_ping_interval_s": "seconds between the client's PINGs to the server (a dead link is noticed after two)",
    "nats_start_timeout_s": "at start, keep trying to reach NATS this long, then exit (rejected credentials exit at "
                            "once); once connected, reconnects never give up",
    "heartbeat_interval_s": "seconds between this service's Sparkwire heartbeats",
    "heartbeat_timeout_s": "a service silent this long is declared dead",
    "drain_timeout_s": "on SIGTERM, finish in-flight requests for at most this long before exiting",
}


class NatsConnection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Servers, TLS, one auth method, and the service's heartbeat and drain timing.

    Auth: at most one of user (+ password), token, nkey seed, creds file; or credentials in a
    URL (`nats://user:pass@host`, `nats://token@host`) when none of those is set.
    """

    nats_url: str = ""  # empty: DEFAULT_URL for a service; `sparkwire up` starts its own server
    nats_tls_ca: str = ""
    nats_tls_cert: str = ""
    nats_tls_key: str = ""
    nats_user: str = ""
    nats_password: str = ""  # secret
    nats_token: str = ""  # secret
    nats_nkey_seed: str = ""
    nats_creds: str = ""
    nats_ping_interval_s: float = 10.0
    nats_start_timeout_s: float = 30.0  # services/common/nats_start.py
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    drain_timeout_s: float = 8.0  # < compose's 10 s stop grace period

    def __post_init__(self) -> None:
        for url in self.servers:
            scheme = urlsplit(url).scheme
            if scheme not in TLS_SCHEMES + PLAIN_SCHEMES:
                raise ValueError(f"{redact_url(url)}: scheme must be nats://, tls://, ws:// or wss://")
        methods = [name for name in ("nats_user", "nats_token", "nats_nkey_seed", "nats_creds") if getattr(self, name)]
        if len(methods) > 1:
            raise ValueError(f"choose one NATS auth method, not {', '.join(methods)}")
        if self.nats_password and not self.nats_user:
            raise ValueError("a NATS password needs a user (SPARKWIRE_NATS_USER or --nats-user)")
        if bool(self.nats_tls_cert) != bool(self.nats_tls_key):
            raise ValueError("--nats-tls-cert and --nats-tls-key go together")
        if not 0 < self.heartbeat_interval_s < self.heartbeat_timeout_s:
            raise ValueError("need 0 < heartbeat_interval_s < heartbeat_timeout_s")
        if self.drain_timeout_s < 0 or self.nats_ping_interval_s <= 0 or self.nats_start_timeout_s <= 0:
            raise ValueError("drain_timeout_s must be >= 0, nats_ping_interval_s and nats_start_timeout_s > 0")
        missing = [f"{name}={getattr(self, name)}" for name in FILE_FIELDS
                   if getattr(self, name) and not Path(getattr(self, name)).is_file()]  # fmt: skip
        if missing:
            raise ValueError(f"NATS connection files not found: {', '.join(missing)}")

    def __repr__(self) -> str:  # never a secret in a log line or a traceback
        shown = {name: getattr(self, name) for name in self.__struct_fields__ if getattr(self, name)}
        shown |= {name: REDACTED for name in SECRET_FIELDS if name in shown}
        if "nats_url" in shown:
            shown["nats_url"] = self.redacted_url
        return f"NatsConnection({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def servers(self) -> tuple[str, ...]:
        """Server URLs in the order they are tried."""
        urls = tuple(_with_scheme(part.strip()) for part in self.nats_url.split(",") if part.strip())
        return urls or (DEFAULT_URL,)

    @property
    def redacted_url(self) -> str:
        return ",".join(redact_url(url) for url in self.servers)

    @property
    def tls(self) -> bool:
        schemes = {urlsplit(url).scheme for url in self.servers}
        return bool(schemes & set(TLS_SCHEMES) or self.nats_tls_ca or self.nats_tls_cert)

    @property
    def auth_method(self) -> str:
        """"creds", "nkey", "token", "user", "url" (credentials inside a server URL) or "none"."""
        if self.nats_creds:
            return "creds"
        if self.nats_nkey_seed:
            return "nkey"
        if self.nats_token:
            return "token"
        if self.nats_user:
            return "user"
        return "url" if any(urlsplit(url).username for url in self.servers) else "none"

    @property
    def auth_description(self) -> str:
        """The auth method in words, for an error line: names and paths, never a secret."""
        return {
            "creds": f"creds file {self.nats_creds}", "nkey": f"nkey seed file {self.nats_nkey_seed}",
            "token": "a token", "user": f"user {self.nats_user!r} with a password",
            "url": "credentials in the server URL", "none": "no credentials",
        }[self.auth_method]  # fmt: skip

    def ssl_context(self) -> ssl.SSLContext | None:
        """Verifies the server against `nats_tls_ca` (else the system's CAs); presents our
        certificate when one is configured. None without TLS."""
        if not self.tls:
            return None
        context = ssl.create_default_context(cafile=self.nats_tls_ca or None)
        if self.nats_tls_cert:
            context.load_cert_chain(self.nats_tls_cert, self.nats_tls_key)
        return context


def as_connection(connection: NatsConnection | str) -> NatsConnection:
    """A plain URL string is one server without TLS or auth (what tests and tools pass)."""
    return NatsConnection(nats_url=connection) if isinstance(connection, str) else connection


def _with_scheme(url: str) -> str:
    return url if "://" in url else f"nats://{url}"


def redact_url(url: str) -> str:
    """`nats://user:secret@host:4222` -> `nats://user:***@host:4222`; a token (user part alone) too."""
    parts = urlsplit(url)
    if not parts.username:
        return url
    user = f"{parts.username}:{REDACTED}" if parts.password is not None else REDACTED
    host = parts.hostname or ""
    netloc = f"{user}@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def url_credentials(url: str) -> tuple[str, str | None] | None:
    """(user, password) from a URL's user part, (token, None) for a user part alone, else None."""
    parts = urlsplit(url)
    if parts.username is None:
        return None
    return unquote(parts.username), unquote(parts.password) if parts.password is not None else None


def host_and_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or 4222


def nats_py_options(connection: NatsConnection) -> dict[str, Any]:
    """The same connection as keyword arguments of `nats.connect` (servers, TLS, auth, pings)."""
    options: dict[str, Any] = {
        "servers": list(connection.servers), "dont_randomize": True, "tls": connection.ssl_context(),
        "ping_interval": connection.nats_ping_interval_s, "max_outstanding_pings": 2,
    }  # fmt: skip
    method = connection.auth_method
    if method == "creds":
        options["user_credentials"] = connection.nats_creds
    elif method == "nkey":
        options["nkeys_seed"] = connection.nats_nkey_seed
    elif method == "token":
        options["token"] = connection.nats_token
    elif method == "user":
        options |= {"user": connection.nats_user, "password": connection.nats_password}
    return options


# The command line: one flag per field, derived here (secrets excepted: environment only).


def add_connection_arguments(parser: argparse.ArgumentParser, environ_values: Mapping[str, str]) -> None:
    """One flag per field; its default from the environment's value, else the field's."""
    defaults = NatsConnection()
    group = parser.add_argument_group(
        "NATS connection", "also SPARKWIRE_<FLAG> variables; the password and token only from "
        "SPARKWIRE_NATS_PASSWORD / SPARKWIRE_NATS_TOKEN, never on a command line",
    )  # fmt: skip
    for name in defaults.__struct_fields__:
        if name in SECRET_FIELDS:
            continue
        kind = type(getattr(defaults, name))
        default = kind(environ_values[name]) if name in environ_values else getattr(defaults, name)
        group.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind, default=default, help=HELP[name])


def connection_from_args(args: argparse.Namespace, environ_values: Mapping[str, str]) -> NatsConnection:
    """The flags' values, and the secrets from the environment, checked together."""
    values = {name: environ_values[name] for name in SECRET_FIELDS if name in environ_values}
    values |= {name: getattr(args, name) for name in NatsConnection.__struct_fields__ if name not in SECRET_FIELDS}
    try:
        return msgspec.convert(values, NatsConnection, strict=False)
    except msgspec.ValidationError as exc:
        raise ValueError(str(exc)) from None

