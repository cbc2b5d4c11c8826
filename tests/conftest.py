"""Fixtures shared by every test: a real nats-server per test, started with the project config."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from services.common.nats_server import PROJECT_CONFIG, NatsServer, start_nats_server


@pytest.fixture
def nats_server() -> Iterator[NatsServer]:
    """A nats-server with the project's config (ops/nats/nats.conf) on a free port."""
    server = start_nats_server()
    yield server
    server.stop()


@pytest.fixture
def nats_server_factory(tmp_path: Path) -> Iterator[Callable[..., NatsServer]]:
    """Start servers with custom limits, e.g. `factory(max_payload="1MB")`; all stopped at the end."""
    started: list[NatsServer] = []

    def start(port: int | None = None, **limits: str) -> NatsServer:
        config = PROJECT_CONFIG
        if limits:
            config = tmp_path / f"nats-{len(started)}.conf"
            lines = [line for line in PROJECT_CONFIG.read_text().splitlines() if line.split(":")[0].strip() not in limits]
            config.write_text("\n".join(lines + [f"{key}: {value}" for key, value in limits.items()]) + "\n")
        server = start_nats_server(config, port=port)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
