"""Every environment variable Sparkwire reads, in one typed table (prefix `SPARKWIRE_`).

Only this module reads the environment. The CLI uses these values as argument defaults, so a
flag always wins over the environment, and the environment over the built-in default.

Two tables: `EnvSettings` below, and the fields of `NatsConnection` (services/common/connection.py:
servers, TLS, auth, heartbeat, drain), each read from `SPARKWIRE_<FIELD>` by
`connection_from_environ`; `connection_environ` writes one back, for a child process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

import msgspec

from services.common.connection import NatsConnection

PREFIX = "SPARKWIRE_"


@dataclass(frozen=True)
class EnvSettings:
    log_level: str = "info"
    log_format: str = "console"  # "console" or "json"
    model: str = ""  # empty: the bundled model (services/models.py: ops/models/sparkwire-micro)
    device: str = "auto"
    event_loop: str = "uvloop"  # "uvloop" or "asyncio" (the standard library's, for debugging)
    api_key: str = ""  # SPARKWIRE_API_KEY: the tokenizer's --api-key (kept out of process lists)
    allocator: str = "tuned"  # "tuned" (services/common/memory.py) or "default" (glibc's own thresholds)
    collector: str = "tuned"  # "tuned" (services/common/memory.py) or "default" (CPython's own thresholds, nothing frozen)
    deterministic: bool = False  # SPARKWIRE_DETERMINISTIC=1: the scheduler's --deterministic

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EnvSettings:
        values = {}
        for spec in fields(cls):
            raw = environ.get(PREFIX + spec.name.upper())
            if raw is not None:
                values[spec.name] = _parse(raw, type(spec.default))
        return cls(**values)


def _parse(raw: str, kind: type) -> object:
    if kind is bool:  # bool("0") would be True
        return raw.strip().lower() in ("1", "true", "yes", "on")
    return kind(raw)


def connection_values(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """`SPARKWIRE_NATS_URL`, `SPARKWIRE_NATS_TLS_CA`, ..., `SPARKWIRE_DRAIN_TIMEOUT_S`: one variable
    per field of `NatsConnection`, the secrets (`SPARKWIRE_NATS_PASSWORD`, `_TOKEN`) included.
    Raw values, checked only once flags are added (`connection.connection_from_args`)."""
    return {name: environ[PREFIX + name.upper()] for name in NatsConnection.__struct_fields__ if PREFIX + name.upper() in environ}


def connection_from_environ(environ: Mapping[str, str] = os.environ) -> NatsConnection:
    return msgspec.convert(connection_values(environ), NatsConnection, strict=False)


def connection_environ(connection: NatsConnection) -> dict[str, str]:
    """The variables that make `connection_from_environ` return `connection` (fields left at
    their defaults are left out): how `sparkwire up` hands a connection to a child process
    without putting a secret on its command line."""
    defaults = NatsConnection()
    return {PREFIX + name.upper(): str(getattr(connection, name)) for name in NatsConnection.__struct_fields__
            if getattr(connection, name) != getattr(defaults, name)}  # fmt: skip
