"""Every environment variable Sparkwire reads, in one typed table (prefix `SPARKWIRE_`).

Only this module reads the environment. The CLI uses these values as argument defaults, so a
flag always wins over the environment, and the environment over the built-in default.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields

PREFIX = "SPARKWIRE_"


@dataclass(frozen=True)
class EnvSettings:
    nats_url: str = ""  # empty: `sparkwire up` starts its own nats-server
    log_level: str = "info"
    log_format: str = "console"  # "console" or "json"
    model: str = ""  # empty: the bundled model (ops/models/sparkwire-tiny)
    device: str = "auto"
    heartbeat_interval_s: float = 0.5
    heartbeat_timeout_s: float = 2.0
    drain_timeout_s: float = 8.0  # on SIGTERM, tokenizer/detokenizer finish in-flight requests this long (< the 10 s grace)
    event_loop: str = "uvloop"  # "uvloop" or "asyncio" (the standard library's, for debugging)
    allocator: str = "tuned"  # "tuned" (services/common/memory.py) or "default" (glibc's own thresholds)

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> EnvSettings:
        values = {}
        for spec in fields(cls):
            raw = environ.get(PREFIX + spec.name.upper())
            if raw is not None:
                values[spec.name] = type(spec.default)(raw)
        return cls(**values)
