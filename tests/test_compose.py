"""compose.yaml is real: its commands parse with the real CLI, and run as local processes (the
nats host swapped for a local nats-server) they serve /generate. No Docker engine needed."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from e2e.stack import Service, Stack, generate_body
from services.cli import build_parser
from services.common.nats_server import start_nats_server

ROOT = Path(__file__).resolve().parents[1]
APP_SERVICES = ("scheduler", "detokenizer", "tokenizer")
COMPOSE_NATS_URL = "nats://nats:4222"


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_has_nats_and_the_three_services(compose):
    assert set(compose["services"]) == {"nats", *APP_SERVICES}


def test_nats_uses_the_official_image_the_project_config_and_a_healthcheck(compose):
    nats = compose["services"]["nats"]
    assert nats["image"].split(":")[0] == "nats"
    command = nats["command"]
    assert command[command.index("-c") + 1] == "/etc/nats/nats.conf" and "-m" in command
    mounts = {mount.split(":")[1]: mount.split(":")[0] for mount in nats["volumes"]}
    assert (ROOT / mounts["/etc/nats/nats.conf"]).resolve() == ROOT / "ops" / "nats" / "nats.conf"
    probe = " ".join(nats["healthcheck"]["test"])
    assert f":{command[command.index('-m') + 1]}/healthz" in probe


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_is_built_from_the_one_dockerfile_and_waits_for_nats(compose, name):
    service = compose["services"][name]
    assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).resolve() == ROOT / "ops" / "docker" / "Dockerfile"
    assert service["depends_on"]["nats"]["condition"] == "service_healthy"
    assert service["command"][:2] == ["sparkwire", name]
    assert COMPOSE_NATS_URL in service["command"]


def test_tokenizer_publishes_port_8000(compose):
    tokenizer = compose["services"]["tokenizer"]
    assert "8000:8000" in tokenizer["ports"]
    command = tokenizer["command"]
    assert command[command.index("--port") + 1] == "8000" and command[command.index("--host") + 1] == "0.0.0.0"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_command_parses_with_the_real_cli(compose, name):
    argv = compose["services"][name]["command"][1:]
    args = build_parser(argv).parse_args(argv)
    assert args.command == name and args.nats_url == COMPOSE_NATS_URL
    assert callable(args.run)


def test_dockerfile_installs_torch_before_the_project():
    lines = [line.strip() for line in (ROOT / "ops" / "docker" / "Dockerfile").read_text().splitlines()]
    assert "FROM python:3.11-slim" in lines
    assert "ARG TORCH_VERSION=2.13.0" in lines
    torch_at = next(i for i, line in enumerate(lines) if re.search(r"pip install \"torch==\$\{TORCH_VERSION\}\"", line))
    project_at = next(i for i, line in enumerate(lines) if line.startswith("RUN pip install -e ."))
    assert torch_at < project_at


def local_argv(command: list[str], nats_url: str, port: int) -> list[str]:
    """The compose command with the compose network swapped for this machine."""
    swap = {COMPOSE_NATS_URL: nats_url, "0.0.0.0": "127.0.0.1", "8000": str(port)}
    return [swap.get(arg, arg) for arg in command[1:]]


@pytest.mark.timeout(180)
def test_compose_commands_run_locally_serve_generate(compose, tmp_path):
    stack = Stack(start_nats_server(), tmp_path)
    try:
        for name in APP_SERVICES:
            argv = [sys.executable, "-m", "services.cli", *local_argv(compose["services"][name]["command"], stack.nats.url, stack.port)]
            stack.services[name] = Service.start(name, argv, tmp_path)
        stack.wait_healthy()
        response = httpx.post(f"{stack.base_url}/generate", json=generate_body(max_new_tokens=4), timeout=30)
        assert response.status_code == 200, f"{response.text}\n{stack.logs()}"
        assert response.json()["meta_info"]["completion_tokens"] > 0
    finally:
        stack.stop()
