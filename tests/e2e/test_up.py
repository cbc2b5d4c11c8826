"""`sparkwire up` as a user runs it: serves /generate, stops cleanly, reports a dying service."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from contracts import subjects
from contracts.control import Heartbeat
from e2e.stack import ROOT, generate_body
from ops.bench.reliability import descendants  # every live process below a pid, from /proc
from services.cli import COMMANDS, build_parser
from services.common.nats_server import free_port, start_nats_server
from services.common.connection import connection_from_args
from services.common.settings import connection_from_environ, connection_values
from services.launcher import service_argv, service_environ
from services.models import BUNDLED_MODEL
from services.recorder.format import read_recording


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def assert_no_secret_on_a_command_line(pids: set[int]) -> set[str]:
    """Each service has its own NATS password (in its environment, readable only by its user);
    none of them is in any process's command line, which every user can read."""
    environs = [dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
                for pid in pids if alive(pid)]  # fmt: skip
    services = [env for env in environs if "SPARKWIRE_NATS_PASSWORD" in env]
    assert {env["SPARKWIRE_NATS_USER"] for env in services} == {"scheduler", "detokenizer", "tokenizer"}
    passwords = {env["SPARKWIRE_NATS_PASSWORD"] for env in services}
    assert len(passwords) == 3
    cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace") for pid in pids if alive(pid)]
    assert not [line for line in cmdlines for password in passwords if password in line]
    return passwords


def start_up(tmp_path: Path, port: int, *extra: str) -> tuple[subprocess.Popen[str], Path]:
    log = tmp_path / f"up-{port}.log"
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "services.cli", "up", "--port", str(port), *extra],
            cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip
    return process, log


def wait_for_line(process: subprocess.Popen[str], log: Path, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in log.read_text():
        assert process.poll() is None, f"sparkwire up exited early:\n{log.read_text()[-4000:]}"
        assert time.monotonic() < deadline, f"no {text!r} after {timeout_s}s:\n{log.read_text()[-4000:]}"
        time.sleep(0.25)


@pytest.mark.timeout(150)
def test_up_serves_generate_and_stops_cleanly_on_sigint(tmp_path):
    port = free_port()
    process, log = start_up(tmp_path, port)
    try:
        wait_for_line(process, log, f"Sparkwire ready on http://127.0.0.1:{port}", 120)
        assert "sparkwire up: serving " + str(BUNDLED_MODEL) in log.read_text()  # the trained pair, by default
        children = descendants(process.pid)
        assert len(children) >= 4, children  # nats-server + three services
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=generate_body(), timeout=30)
        assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] > 0
        passwords = assert_no_secret_on_a_command_line(children)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=20) == 0, log.read_text()[-4000:]
        assert not any(password in log.read_text() for password in passwords)  # nor in any log line
        lines = log.read_text().splitlines()
        frozen = {line.split("]", 1)[0][1:] for line in lines if "memory.startup_heap_frozen" in line}
        assert frozen == {"scheduler", "detokenizer", "tokenizer"}  # each service, once ready (memory.settle_startup_heap)
        assert any(line.startswith("[scheduler] ") and "scheduler.stopped" in line and "gc_collections=" in line for line in lines)
        assert [pid for pid in children if alive(pid)] == []
    finally:
        if process.poll() is None:
            process.kill()


def post_fresh(url: str, body: dict) -> httpx.Response:
    """On a new connection: SO_REUSEPORT picks a listener per connection, so each may reach another tokenizer."""
    with httpx.Client() as client:
        return client.post(url, json=body, timeout=30)


def grown_only(page: str) -> dict:
    """The samples of a /metrics page that may only grow (counters, histogram buckets, counts, sums)."""
    kinds = {"counter", "histogram"}
    return {(s.name, tuple(sorted(s.labels.items()))): s.value for f in text_string_to_metric_families(page)
            if f.type in kinds for s in f.samples if not s.name.endswith("_created")}  # fmt: skip


def requests_served_by(log: Path, names: tuple[str, ...], total: int) -> dict[str, int]:
    """`request.finished` lines per tokenizer. A request's line is logged after its response has
    gone out, and the launcher relays each child's lines on its own: the last may come a moment late."""
    deadline = time.monotonic() + 10
    while True:
        lines = log.read_text().splitlines()
        served = {name: sum(line.startswith(f"[{name}] ") and "request.finished" in line for line in lines) for name in names}
        if sum(served.values()) >= total or time.monotonic() > deadline:
            return served
        time.sleep(0.1)


def shared_metrics_dir(up_pid: int) -> Path:
    """The --metrics-dir `up` gave its tokenizers (from their command lines)."""
    argvs = [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") for pid in descendants(up_pid) if alive(pid)]
    dirs = {argv[argv.index(b"--metrics-dir") + 1].decode() for argv in argvs if b"--metrics-dir" in argv}
    assert len(dirs) == 1, dirs
    return Path(dirs.pop())


@pytest.mark.timeout(180)
def test_up_with_three_tokenizers_serves_one_port_and_one_metrics_page_that_never_goes_back(tmp_path):
    """`--tokenizers 3`: three tokenizer processes listen on the one port (SO_REUSEPORT); the kernel
    spreads new connections over them and each serves its share. /metrics on that port answers the
    sum of all three (services/common/metrics_shared.py): 20 scrapes on fresh connections while
    requests run never see a counter go down, and once the load is over it counts every request."""
    port = free_port()
    process, log = start_up(tmp_path, port, "--tokenizers", "3")
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for_line(process, log, f"Sparkwire ready on {base}", 120)
        metrics_dir = shared_metrics_dir(process.pid)
        assert len(list(metrics_dir.glob("*.msgpack"))) == 3  # one snapshot per tokenizer
        done: list[httpx.Response] = []
        stop = threading.Event()

        def load() -> None:
            while not stop.is_set() or len(done) < 24:
                done.append(post_fresh(f"{base}/generate", generate_body(max_new_tokens=2)))

        loader = threading.Thread(target=load)
        loader.start()
        pages = []
        for _ in range(20):
            pages.append(grown_only(httpx.get(f"{base}/metrics", timeout=10).text))
            time.sleep(0.15)
        stop.set()
        loader.join()
        assert [r.status_code for r in done] == [200] * len(done) and all(r.json()["meta_info"]["completion_tokens"] == 2 for r in done)
        went_back = [(key, a[key], b.get(key)) for a, b in zip(pages, pages[1:]) for key in a if b.get(key, 0) < a[key]]
        assert went_back == [], went_back[:5]
        served = requests_served_by(log, ("tokenizer", "tokenizer-2", "tokenizer-3"), len(done))
        assert sum(served.values()) == len(done) and min(served.values()) > 0, served
        time.sleep(1.5)  # every tokenizer has published its counts since (PUBLISH_INTERVAL_S)
        last = grown_only(httpx.get(f"{base}/metrics", timeout=10).text)
        model = ("model_name", BUNDLED_MODEL.name)
        assert last[("sparkwire:tokenizer_requests_finished_total", (("finished_reason", "length"), model))] == len(done)
        assert last[("sparkwire:http_requests_total", (("handler", "/generate"), ("method", "POST"), ("status", "200")))] == len(done)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-4000:]
        assert not metrics_dir.exists()  # `up` removes what its tokenizers published
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.timeout(180)
def test_up_records_every_message_of_a_request_and_the_recording_replays(tmp_path):
    """`--record FILE`: the recorder subscribes before the services start and stops after them, so
    the file holds a request's whole path (claim, generate, token and text batches) and the
    services' first heartbeats and dead sentinels; `sparkwire replay` plays it back."""
    port, recording = free_port(), tmp_path / "up.swrec"
    process, log = start_up(tmp_path, port, "--record", str(recording))
    try:
        wait_for_line(process, log, f"Sparkwire ready on http://127.0.0.1:{port}", 120)
        output = log.read_text()
        assert output.index(f"recording every message to {recording}") < output.index("[scheduler]")
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=generate_body(), timeout=30)
        assert response.status_code == 200
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
    messages = read_recording(recording).messages
    kinds = {m.subject.split(".")[2] + "." + m.subject.split(".")[-1] for m in messages}
    assert {"scheduler.claim", "detokenizer.tokens", "tokenizer.outputs", "heartbeat.scheduler"} <= kinds, kinds
    assert any(m.subject.startswith(f"{subjects.PREFIX}.scheduler.") and m.subject.endswith(".generate") for m in messages)
    beats = [msgspec.msgpack.decode(m.data, type=Heartbeat) for m in messages if m.subject == subjects.heartbeat("scheduler")]
    assert beats[0].alive and not beats[-1].alive  # from its first beat to its dead sentinel
    server = start_nats_server()
    try:
        replayed = subprocess.run([sys.executable, "-m", "services.cli", "replay", str(recording), "--nats-url", server.url],
                                  cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    finally:
        server.stop()
    assert replayed.returncode == 0 and f"replayed {len(messages)} messages" in replayed.stdout, replayed.stdout + replayed.stderr


@pytest.mark.timeout(120)
def test_up_reports_a_service_that_dies_and_exits_non_zero(tmp_path):
    (tmp_path / "empty-model").mkdir()  # a model directory the services refuse (a missing one `up` refuses itself)
    process, log = start_up(tmp_path, free_port(), "--model", str(tmp_path / "empty-model"))
    try:
        assert process.wait(timeout=100) != 0
        output = log.read_text()
        assert "exited with code" in output and "last output lines" in output, output[-4000:]
        # one clear line, from whichever service dies first (a race: the tokenizer's or the detokenizer's words)
        missing = ("has no tokenizer.json", "tokenizer file not found")
        assert any(words in output for words in missing) and "Traceback" not in output, output[-4000:]
        assert "Sparkwire ready" not in output
    finally:
        if process.poll() is None:
            process.kill()


@pytest.mark.timeout(60)
def test_up_refuses_a_model_that_is_neither_a_path_nor_an_id_before_starting_anything(tmp_path):
    process, log = start_up(tmp_path, free_port(), "--model", str(tmp_path / "no-such-model"))
    try:
        assert process.wait(timeout=50) == 2
        output = log.read_text()
        assert "cannot load" in output and "no-such-model" in output and "not a Hugging Face model id" in output
        assert "exited with code" not in output and "Traceback" not in output  # no service was started
    finally:
        if process.poll() is None:
            process.kill()


# The CLI wiring behind `up`, without starting anything.


def test_help_works_while_a_service_cannot_be_imported(monkeypatch, capsys):
    for command in COMMANDS.values():
        monkeypatch.setitem(sys.modules, command.module, None)  # importing it now raises ImportError
    with pytest.raises(SystemExit) as done:
        build_parser(["--help"]).parse_args(["--help"])
    assert done.value.code == 0 and "scheduler" in capsys.readouterr().out
    args = build_parser(["up", "--port", "9000"]).parse_args(["up", "--port", "9000"])
    assert args.port == 9000 and args.nats_url == ""  # empty: start an embedded nats-server
    with pytest.raises(ImportError):
        build_parser(["scheduler"])


def test_up_passes_each_service_its_flags():
    argv = ["up", "--model", "/m", "--draft-model", "/d", "--speculative-algorithm", "dspark", "--device", "cpu",
            "--load-format", "dummy", "--port", "9001", "--logprobs-mode", "processed", "--chunked-prefill-size", "64",
            "--max-logprobs", "5"]  # fmt: skip
    args = build_parser(argv).parse_args(argv)
    scheduler = service_argv("scheduler", args)
    tokenizer = service_argv("tokenizer", args)
    detokenizer = service_argv("detokenizer", args)
    assert scheduler[1:4] == ["-m", "services.cli", "scheduler"]
    for flag, value in [("--draft-model", "/d"), ("--speculative-algorithm", "dspark"), ("--device", "cpu"),
                        ("--load-format", "dummy"), ("--model", "/m"),
                        ("--logprobs-mode", "processed"), ("--chunked-prefill-size", "64")]:  # fmt: skip
        assert scheduler[scheduler.index(flag) + 1] == value
    assert tokenizer[tokenizer.index("--port") + 1] == "9001" and tokenizer[tokenizer.index("--host") + 1] == "127.0.0.1"
    assert tokenizer[tokenizer.index("--max-logprobs") + 1] == "5"
    assert "--port" not in detokenizer and "--device" not in detokenizer
    assert detokenizer[detokenizer.index("--model") + 1] == "/m"


def test_up_hands_each_service_the_connection_through_its_environment_not_its_argv(monkeypatch):
    monkeypatch.setenv("SPARKWIRE_NATS_PASSWORD", "hunter2")
    monkeypatch.setenv("SPARKWIRE_NATS_TOKEN", "stale")  # inherited but not part of the connection
    argv = ["up", "--nats-url", "tls://a:1,tls://b:2", "--nats-user", "sched", "--heartbeat-interval-s", "0.25"]
    args = build_parser(argv).parse_args(argv)
    monkeypatch.delenv("SPARKWIRE_NATS_TOKEN")
    connection = connection_from_args(args, connection_values())
    env = service_environ(connection)
    assert not any("hunter2" in arg or "tls://" in arg for arg in service_argv("scheduler", args))
    assert env["SPARKWIRE_NATS_PASSWORD"] == "hunter2" and "SPARKWIRE_NATS_TOKEN" not in env
    assert connection_from_environ(env) == connection and connection.servers == ("tls://a:1", "tls://b:2")
    assert "hunter2" not in repr(connection)


def test_the_service_commands_up_builds_parse_with_the_real_cli():
    args = build_parser(["up"]).parse_args(["up"])
    for name in ("scheduler", "detokenizer", "tokenizer"):
        argv = service_argv(name, args)[3:]
        parsed = build_parser(argv).parse_args(argv)
        assert parsed.command == name and callable(parsed.run)


def test_bench_names_its_benchmarks(capsys):
    with pytest.raises(SystemExit):
        build_parser(["bench", "--help"]).parse_args(["bench", "--help"])
    assert "logprob-transport" in capsys.readouterr().out
