"""compose.yaml is real, without a Docker engine: it validates against the Compose specification's
JSON schema, its images are built per role as documented, and its services' commands run as
local processes behind the real HAProxy with the committed config (two tokenizers, two
detokenizers), serving /generate on the proxy's one port.

Only the addresses differ locally: Docker's DNS (127.0.0.11) becomes a tiny DNS responder here
that answers `tokenizer` with one loopback address per replica, as Docker's does per container.
"""

from __future__ import annotations

import importlib.resources
import json
import re
import shutil
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml

from prometheus_client.parser import text_string_to_metric_families

from e2e.stack import Service, generate_body
from services.cli import build_parser
from services.common.nats_server import free_port, start_nats_server, stop_process
from services.models import BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]
APP_SERVICES = ("scheduler", "scheduler-tp", "scheduler-cpu", "detokenizer", "tokenizer")
HAPROXY_CFG = ROOT / "ops" / "docker" / "haproxy.cfg"
REPLICA_HOSTS = ("127.0.0.2", "127.0.0.3")


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def compose_schema() -> dict:
    """The Compose specification's schema, as the check-jsonschema package ships it (Apache-2.0)."""
    vendor = importlib.resources.files("check_jsonschema.builtin_schemas.vendor")
    return json.loads(vendor.joinpath("compose-spec.json").read_text())


def schema_errors(document: dict) -> list[str]:
    schema = compose_schema()
    validator = jsonschema.validators.validator_for(schema)(schema)
    return [f"{list(error.path)}: {error.message}" for error in validator.iter_errors(document)]


def test_compose_yaml_validates_against_the_compose_specification(compose):
    assert schema_errors(compose) == []
    broken = {**compose, "services": {**compose["services"], "tokenizer": {**compose["services"]["tokenizer"], "ports": "8000"}}}
    assert schema_errors(broken)  # the check can fail


def test_every_service_has_a_healthcheck(compose):
    assert set(compose["services"]) == {"nats", "proxy", *APP_SERVICES}
    assert all(service["healthcheck"]["test"] for service in compose["services"].values())


def test_scheduler_reserves_a_gpu_and_a_cpu_profile_runs_without_one(compose):
    devices = compose["services"]["scheduler"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    cpu = compose["services"]["scheduler-cpu"]
    assert cpu["profiles"] == ["cpu"] and "deploy" not in cpu and "--device" in cpu["command"]
    assert cpu["command"][cpu["command"].index("--device") + 1] == "cpu"


def test_a_tensor_parallel_scheduler_takes_as_many_gpus_as_ranks(compose):
    tp = compose["services"]["scheduler-tp"]
    size = int(tp["command"][tp["command"].index("--tensor-parallel-size") + 1])
    assert tp["profiles"] == ["tp"] and size > 1
    assert tp["deploy"]["resources"]["reservations"]["devices"] == [{"driver": "nvidia", "count": size, "capabilities": ["gpu"]}]
    argv = tp["command"][1:]
    args = build_parser(argv).parse_args(argv)  # the command parses as written
    assert args.tensor_parallel_size == size


def test_one_port_through_the_proxy_and_none_on_the_replicas(compose):
    proxy = compose["services"]["proxy"]
    assert proxy["image"].split(":")[0] == "haproxy" and proxy["ports"] == ["8000:8000"]
    assert (ROOT / proxy["volumes"][0].split(":")[0]).resolve() == HAPROXY_CFG
    assert all("ports" not in compose["services"][name] for name in APP_SERVICES)
    assert re.search(r"server-template \w+ \d+ tokenizer:8000", HAPROXY_CFG.read_text())


def dockerfile_lines(name: str) -> list[str]:
    """Instructions only (comments dropped)."""
    lines = (line.strip() for line in (ROOT / "ops" / "docker" / name).read_text().splitlines())
    return [line for line in lines if not line.startswith("#")]


@pytest.mark.parametrize("name, dockerfile", [("scheduler", "scheduler.Dockerfile"), ("scheduler-cpu", "scheduler.Dockerfile"),
                                               ("detokenizer", "frontend.Dockerfile"), ("tokenizer", "frontend.Dockerfile")])  # fmt: skip
def test_images_per_role_install_dependencies_before_the_source(compose, name, dockerfile):
    build = compose["services"][name]["build"]
    assert (ROOT / build["context"] / build["dockerfile"]).resolve() == ROOT / "ops" / "docker" / dockerfile
    lines = dockerfile_lines(dockerfile)
    dependencies = next(i for i, line in enumerate(lines) if "pip install -r /tmp/requirements.txt" in line)
    source = next(i for i, line in enumerate(lines) if line.startswith("COPY services"))
    assert dependencies < source


def test_the_frontend_image_has_no_torch_and_the_scheduler_image_a_compiler():
    frontend, scheduler = " ".join(dockerfile_lines("frontend.Dockerfile")), " ".join(dockerfile_lines("scheduler.Dockerfile"))
    assert "torch" not in frontend and "'dependencies'" in frontend and "optional-dependencies" not in frontend
    assert "ARG BASE_IMAGE=nvidia/cuda:" in scheduler and "gcc" in scheduler and "python3-dev" in scheduler
    assert scheduler.index('pip install "torch==${TORCH_VERSION}"') < scheduler.index("COPY services")


@pytest.mark.parametrize("name, flash4", [("scheduler", True), ("scheduler-cpu", False)])
def test_the_cuda_scheduler_image_installs_flash4_and_the_cpu_one_does_not(compose, name, flash4, tmp_path):
    """The Dockerfile's requirements line, run here with each image's build args: FlashAttention-4
    (pyproject's `flash4` extra) on the CUDA image only, beside the scheduler extra."""
    lines = dockerfile_lines("scheduler.Dockerfile")
    default = next(line for line in lines if line.startswith("ARG SCHEDULER_EXTRAS=")).split("=", 1)[1].strip('"')
    extras = compose["services"][name]["build"].get("args", {}).get("SCHEDULER_EXTRAS", default)
    text = "\n".join(lines)
    command = text[text.index('python -c "') + len('python -c "') : text.index('" > /tmp/requirements.txt')].replace("\\\n", "")
    (tmp_path / "pyproject.toml").write_bytes((ROOT / "pyproject.toml").read_bytes())
    result = subprocess.run([sys.executable, "-c", command], cwd=tmp_path, env={"SCHEDULER_EXTRAS": extras},
                            capture_output=True, text=True, check=True)  # fmt: skip
    requirements = result.stdout.split()
    assert any(r.startswith("torch") for r in requirements) and any(r.startswith("safetensors") for r in requirements)
    assert any(r.startswith("flash-attn-4==") for r in requirements) == flash4
    assert not any(r.startswith("sparkwire") for r in requirements)  # flash4's own `sparkwire[scheduler]`: not on PyPI


@pytest.mark.parametrize("name", APP_SERVICES)
def test_service_command_parses_with_the_real_cli(compose, name):
    argv = compose["services"][name]["command"][1:]
    args = build_parser(argv).parse_args(argv)
    assert args.command == name.removesuffix("-cpu").removesuffix("-tp") and callable(args.run)
    assert compose["services"][name]["environment"]["SPARKWIRE_NATS_URL"] == "nats://nats:4222"


# ---- the model: one volume, one variable ----

MODELS_MOUNT = "/models"
DEFAULT_MODEL = "/models/sparkwire-micro"


def interpolate(value: str, environ: dict[str, str]) -> str:
    """Compose's `${VAR}` and `${VAR:-default}` (empty or unset: the default)."""
    return re.sub(r"\$\{(\w+)(?::-([^}]*))?\}", lambda m: environ.get(m[1]) or (m[2] or ""), value)


def model_volume(service: dict, environ: dict[str, str]) -> tuple[Path, str]:
    """(host directory, mount point) of the read-only model volume, as compose would resolve them."""
    mounts = [interpolate(volume, environ).split(":") for volume in service["volumes"]]
    source, target, mode = next(mount for mount in mounts if mount[1] == MODELS_MOUNT)
    assert mode == "ro"
    return (ROOT / source).resolve(), target


def host_path(service: dict, environ: dict[str, str]) -> Path:
    """Where the directory SPARKWIRE_MODEL names inside a container lies on the host."""
    source, target = model_volume(service, environ)
    model = interpolate(service["environment"]["SPARKWIRE_MODEL"], environ)
    assert model.startswith(target + "/"), model
    return source / model.removeprefix(target + "/")


@pytest.mark.parametrize("name", APP_SERVICES)
def test_every_service_reads_its_model_from_the_one_volume_and_variable(compose, name):
    service = compose["services"][name]
    assert host_path(service, {}) == BUNDLED_MODEL  # unset: the demo, through the same mount
    real = {"MODELS_DIR": "/srv/models", "SPARKWIRE_MODEL": "/models/Qwen3-8B"}
    assert host_path(service, real) == Path("/srv/models/Qwen3-8B")  # README's example


@pytest.mark.parametrize("name", APP_SERVICES)
def test_the_service_loads_the_model_sparkwire_model_names(compose, name, monkeypatch):
    """The CLI takes SPARKWIRE_MODEL (services/common/settings.py) as every service's --model."""
    monkeypatch.setenv("SPARKWIRE_MODEL", "/models/Qwen3-8B")
    argv = compose["services"][name]["command"][1:]
    assert str(build_parser(argv).parse_args(argv).model) == "/models/Qwen3-8B"


def test_the_tokenizers_share_their_metrics_through_a_volume_the_image_lets_them_write(compose):
    tokenizer = compose["services"]["tokenizer"]
    directory = tokenizer["command"][tokenizer["command"].index("--metrics-dir") + 1]
    assert f"tokenizer-metrics:{directory}" in tokenizer["volumes"] and "tokenizer-metrics" in compose["volumes"]
    frontend = " ".join(dockerfile_lines("frontend.Dockerfile"))
    assert f"mkdir -p {directory} && chown sparkwire:sparkwire {directory}" in frontend
    assert frontend.index("chown sparkwire") < frontend.index("USER sparkwire")


# ---- the local run ----


class FakeDockerDns:
    """Answers A queries for `tokenizer` with one address per replica; anything else: no answer."""

    def __init__(self, name: str, addresses: tuple[str, ...]) -> None:
        self.name, self.addresses = name, addresses
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            try:
                query, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            self.sock.sendto(self.answer(query), peer)

    def answer(self, query: bytes) -> bytes:
        end = 12
        labels = []
        while query[end]:
            labels.append(query[end + 1 : end + 1 + query[end]].decode())
            end += 1 + query[end]
        question = query[12 : end + 5]  # name, its 0 byte, type and class
        qtype = struct.unpack("!H", query[end + 1 : end + 3])[0]
        found = self.addresses if qtype == 1 and labels and labels[0] == self.name else ()
        header = struct.pack("!HHHHHH", struct.unpack("!H", query[:2])[0], 0x8180, 1, len(found), 0, 0)
        records = b"".join(struct.pack("!HHHIH", 0xC00C, 1, 1, 1, 4) + socket.inet_aton(address) for address in found)
        return header + question + records

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


def local_haproxy_cfg(dns_port: int, proxy_port: int, health_port: int, tokenizer_port: int) -> str:
    """The committed config with only this machine's addresses swapped in."""
    swaps = {"127.0.0.11:53": f"127.0.0.1:{dns_port}", "bind :8000": f"bind 127.0.0.1:{proxy_port}",
             "bind :8404": f"bind 127.0.0.1:{health_port}", "tokenizer:8000": f"tokenizer:{tokenizer_port}"}  # fmt: skip
    text = HAPROXY_CFG.read_text()
    for old, new in swaps.items():
        assert old in text, old
        text = text.replace(old, new)
    return text


def local_argv(command: list[str], swaps: dict[str, str]) -> list[str]:
    return [sys.executable, "-m", "services.cli", *(swaps.get(arg, arg) for arg in command[1:])]


def count_in_log(service: Service, text: str) -> int:
    return service.log_path.read_text(errors="replace").count(text)


@pytest.fixture
def local_compose(compose, tmp_path) -> Iterator[tuple[str, dict[str, Service], Path]]:
    """nats, scheduler-cpu, 2 detokenizers, 2 tokenizers and the proxy, as local processes."""
    haproxy = shutil.which("haproxy")
    assert haproxy, "haproxy is not installed (.ci/run installs Debian's package)"
    nats = start_nats_server()
    dns = FakeDockerDns("tokenizer", REPLICA_HOSTS)
    services: dict[str, Service] = {}
    tokenizer_port, proxy_port, health_port = free_port(), free_port(), free_port()
    tokenizer = compose["services"]["tokenizer"]
    # The environment compose gives them, with the model's container path where its volume puts it here.
    env = {**{key: interpolate(value, {}) for key, value in tokenizer["environment"].items()}, "SPARKWIRE_NATS_URL": nats.url,
           "SPARKWIRE_MODEL": str(host_path(tokenizer, {}))}  # fmt: skip
    shared = {"/var/lib/sparkwire/metrics": str(tmp_path / "tokenizer-metrics")}  # the tokenizer-metrics volume
    proxy = None
    try:
        plan = [("scheduler-cpu", "scheduler-cpu", {}), *((f"detokenizer-{i}", "detokenizer", {}) for i in range(2)),
                *((f"tokenizer-{i}", "tokenizer", {"0.0.0.0": host, "8000": str(tokenizer_port), **shared})
                  for i, host in enumerate(REPLICA_HOSTS))]  # fmt: skip
        for label, name, swaps in plan:
            swaps = {"9090": str(free_port()), **swaps}  # each replica's metrics port (a container each in compose)
            services[label] = Service.start(label, local_argv(compose["services"][name]["command"], swaps), tmp_path, env=env)
        config = tmp_path / "haproxy.cfg"
        config.write_text(local_haproxy_cfg(dns.port, proxy_port, health_port, tokenizer_port))
        with (tmp_path / "haproxy.log").open("wb") as log:
            proxy = subprocess.Popen([haproxy, "-db", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT)
        yield f"http://127.0.0.1:{proxy_port}", services, tmp_path / "haproxy.log"
    finally:
        if proxy is not None:
            stop_process(proxy, grace_s=5)
        for service in services.values():
            service.stop()
        dns.close()
        nats.stop()


def wait_until_served(base_url: str, services: dict[str, Service], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        dead = [service.log_tail() for service in services.values() if service.process.poll() is not None]
        assert not dead, "\n".join(dead)
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError("\n".join(service.log_tail() for service in services.values()))


def wait_for_replicas_up(proxy_log: Path, count: int, timeout_s: float = 30.0) -> None:
    """HAProxy found `count` replicas through DNS and their /health checks passed."""
    deadline = time.monotonic() + timeout_s
    while len(set(re.findall(r"Server tokenizers/(tokenizer\d+) is UP", proxy_log.read_text()))) < count:
        assert time.monotonic() < deadline, proxy_log.read_text()[-3000:]
        time.sleep(0.2)


def wait_for_proxy_log_lines(proxy_log: Path, pattern: str, count: int, timeout_s: float = 10.0) -> list[str]:
    """HAProxy writes a request's log line when the stream closes, which can come after the client has its
    response: wait until `count` lines match (or the deadline passes) and return what matched."""
    deadline = time.monotonic() + timeout_s
    while len(found := re.findall(pattern, proxy_log.read_text())) < count and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.mark.timeout(240)
def test_compose_commands_serve_behind_the_proxy_with_two_tokenizers_and_two_detokenizers(local_compose):
    base_url, services, proxy_log = local_compose
    wait_until_served(base_url, services)
    wait_for_replicas_up(proxy_log, len(REPLICA_HOSTS))
    prompts = [f"def step_{index}(x):" for index in range(12)]
    with ThreadPoolExecutor(4) as pool:
        responses = list(pool.map(lambda p: httpx.post(f"{base_url}/generate", json=generate_body(text=p, max_new_tokens=4), timeout=60), prompts))
    assert [response.status_code for response in responses] == [200] * len(prompts), responses[0].text
    served_by = wait_for_proxy_log_lines(proxy_log, r"tokenizers/(tokenizer\d+) .*\"POST /generate", len(prompts))
    assert len(served_by) == len(prompts) and len(set(served_by)) == 2, served_by
    registered = [count_in_log(services[f"detokenizer-{i}"], "detokenizer.registered") for i in range(2)]
    assert sum(registered) >= len(prompts) and min(registered) > 0, registered
    time.sleep(1.5)  # both replicas have published their counts to the shared volume since
    finished = ("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "length"), ("model_name", BUNDLED_MODEL.name)))
    for _ in range(4):  # whichever replica the proxy picks answers for both
        page = httpx.get(f"{base_url}/metrics", timeout=10).text
        got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(page) for s in f.samples}
        assert got[finished] == len(prompts)
