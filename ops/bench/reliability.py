"""`sparkwire bench reliability`: hostile input, faults and load against the real stack.

One `sparkwire up` (the bundled model on CPU by default) is started for the run, and these cases
run against it in order:
- hostile_http: every body of `reliability_inputs.http_cases` must get a 4xx with an error body;
- hostile_nats: `reliability_inputs.nats_messages` on every subject a service reads, while
  requests run; no service may die or restart and those requests must complete correctly;
- kill_<service>: SIGKILL of the scheduler, detokenizer and tokenizer while requests run, then
  (`up` restarts it) the stack must serve again;
- restart_nats: SIGKILL of the embedded nats-server while requests run (`up` restarts it);
- concurrent: `num_concurrent` requests at once, every one must complete correctly.

Every request is greedy with `ignore_eos`, so its right answer is known (a quiet run first) and
each ends as exactly one of: complete (the right tokens), failed clearly (4xx/503 with an error
body, an SSE error event, an abort finish with a message, or a broken connection the client
sees), lost (no answer within the timeout), short (ended looking complete, but other tokens), or
server error (a 5xx other than the documented 503). The report (JSON + table) counts them per case
with the faults injected and survived; lost, short and server errors must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shlex
import signal
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import nats

from ops.bench.common import RESULTS, script
from ops.bench.reliability_inputs import HttpCase, http_cases, nats_messages
from ops.bench.serve_launch import launched_stack
from services.common.nats_server import free_port

ALL_CASES = ("hostile_http", "hostile_nats", "kill_scheduler", "kill_detokenizer", "kill_tokenizer", "restart_nats", "concurrent")
PROMPT = "def fibonacci(n):"
MUST_BE_ZERO = ("lost", "short", "server_errors")


@dataclass(frozen=True)
class ReliabilityConfig:
    cases: tuple[str, ...] = ALL_CASES
    num_concurrent: int = 256  # the load case
    num_in_flight: int = 16  # requests running while a fault hits
    max_new_tokens: int = 32  # per request of the load case
    fault_tokens: int = 300  # per request running through a fault: long enough to be hit mid-stream
    nats_repeat: int = 3  # each hostile NATS message is sent this many times
    request_timeout_s: float = 120.0
    recover_timeout_s: float = 180.0  # for `up` to bring a killed process back and /health to be 200
    up_args: tuple[str, ...] = ()
    up_log: Path | None = None


@dataclass
class Tally:
    """What happened to one case's requests and faults."""

    sent: int = 0
    complete: int = 0
    failed_clearly: int = 0
    lost: int = 0
    short: int = 0
    server_errors: int = 0  # 5xx other than 503
    accepted: int = 0  # hostile input answered 2xx: listed in notes
    unavailable_503: int = 0  # also counted in failed_clearly: the documented "try again"
    connection_errors: int = 0  # also counted in failed_clearly: the client saw its connection break
    faults_injected: int = 0
    faults_survived: int = 0
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> None:
        self.sent += 1
        if outcome in ("unavailable_503", "connection_errors"):
            setattr(self, outcome, getattr(self, outcome) + 1)
            outcome = "failed_clearly"
        setattr(self, outcome, getattr(self, outcome) + 1)


@dataclass
class Bench:
    """The running stack and what every case needs from it."""

    config: ReliabilityConfig
    url: str
    up_pid: int
    log_path: Path
    client: httpx.AsyncClient
    references: dict[int, list[int]] = field(default_factory=dict)  # max_new_tokens -> greedy output ids

    def body(self, max_new_tokens: int, stream: bool) -> dict[str, Any]:
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        return {"text": PROMPT, "sampling_params": sampling, "stream": stream}

    async def reference(self, max_new_tokens: int) -> list[int]:
        if max_new_tokens not in self.references:
            response = await self.client.post(f"{self.url}/generate", json=self.body(max_new_tokens, False))
            response.raise_for_status()
            self.references[max_new_tokens] = response.json()["output_ids"]
        return self.references[max_new_tokens]


# ---- one request, classified ----


async def one_request(bench: Bench, max_new_tokens: int, stream: bool, started: asyncio.Event | None = None) -> str:
    reference = await bench.reference(max_new_tokens)
    try:
        async with asyncio.timeout(bench.config.request_timeout_s):
            if stream:
                return await _streamed(bench, max_new_tokens, reference, started)
            if started is not None:
                started.set()
            response = await bench.client.post(f"{bench.url}/generate", json=bench.body(max_new_tokens, False))
            return _status_outcome(response) or _final_outcome(response.json(), reference)
    except TimeoutError:
        return "lost"
    except httpx.TransportError:
        return "connection_errors"


async def _streamed(bench: Bench, max_new_tokens: int, reference: list[int], started: asyncio.Event | None) -> str:
    last: dict[str, Any] = {}
    done = False
    async with bench.client.stream("POST", f"{bench.url}/generate", json=bench.body(max_new_tokens, True)) as response:
        if (outcome := _status_outcome(response, streamed=True)) is not None:
            return outcome
        async for line in response.aiter_lines():
            payload = line.removeprefix("data:").strip() if line.startswith("data:") else None
            if payload == "[DONE]":
                done = True
            elif payload:
                last = json.loads(payload)
                if started is not None:
                    started.set()
    if not done and "error" not in last:
        return "connection_errors"  # the stream broke off: the client sees no [DONE]
    return _final_outcome(last, reference)


def _status_outcome(response: httpx.Response, streamed: bool = False) -> str | None:
    if response.status_code == 200:
        return None
    if response.status_code == 503:
        return "unavailable_503"
    return "server_errors" if response.status_code >= 500 else "failed_clearly"


def _final_outcome(last: dict[str, Any], reference: list[int]) -> str:
    finish = (last.get("meta_info") or {}).get("finish_reason") or {}
    if "error" in last or (finish.get("type") == "abort" and finish.get("message")):
        return "failed_clearly"
    return "complete" if last.get("output_ids") == reference else "short"


async def requests_through(
    bench: Bench, tally: Tally, fault: Callable[[], Awaitable[None]], num: int, max_new_tokens: int
) -> None:
    """`num` requests (half streamed) with `fault` injected once the first has produced output."""
    started = asyncio.Event()
    tasks = [asyncio.create_task(one_request(bench, max_new_tokens, i % 2 == 0, started)) for i in range(num)]
    with_timeout = asyncio.wait_for(started.wait(), bench.config.request_timeout_s)
    await asyncio.gather(with_timeout, return_exceptions=True)
    await fault()
    for outcome in await asyncio.gather(*tasks):
        tally.count(outcome)


# ---- processes under `sparkwire up` ----


def descendants(pid: int) -> set[int]:
    """Every live process below `pid`, from /proc (the parent field of each process's stat; an
    embedded nats-server runs in its own session and is still found)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    found, frontier = set(), {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def pid_of(bench: Bench, process: str) -> int:
    """The pid of a service (`scheduler`, ...) or of `nats-server`, under the `up` process."""
    for pid in descendants(bench.up_pid):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if (process == "nats-server" and argv[0].endswith("nats-server")) or argv[2:4] == ["services.cli", process]:
            return pid
    raise LookupError(f"no {process} process under sparkwire up (pid {bench.up_pid})")


def service_pids(bench: Bench) -> dict[str, int]:
    return {name: pid_of(bench, name) for name in ("scheduler", "detokenizer", "tokenizer", "nats-server")}


async def recovered(bench: Bench) -> bool:
    """/health 200 again and a request answered correctly, within `recover_timeout_s`."""
    deadline = time.monotonic() + bench.config.recover_timeout_s
    while time.monotonic() < deadline:
        try:
            healthy = (await bench.client.get(f"{bench.url}/health", timeout=2)).status_code == 200
        except httpx.HTTPError:
            healthy = False
        if healthy and await one_request(bench, bench.config.max_new_tokens, stream=False) == "complete":
            return True
        await asyncio.sleep(0.5)
    return False


# ---- the cases ----


async def hostile_http(bench: Bench, tally: Tally) -> None:
    cases = http_cases()
    for case in cases:
        outcome = await _hostile_post(bench, case)
        tally.count(outcome)
        if outcome != "failed_clearly":
            tally.notes.append(f"{case.name}: {outcome}")
    tally.faults_injected = len(cases)
    tally.faults_survived = len(cases) if await recovered(bench) else 0


async def _hostile_post(bench: Bench, case: HttpCase) -> str:
    try:
        response = await bench.client.post(f"{bench.url}{case.path}", content=case.body, headers=case.headers)
    except httpx.TransportError:
        return "connection_errors"
    if response.status_code >= 500:
        return "server_errors"
    has_error_body = 400 <= response.status_code < 500 and bool(response.json().get("error", {}).get("message"))
    return "failed_clearly" if has_error_body else "accepted"


async def hostile_nats(bench: Bench, tally: Tally) -> None:
    before = service_pids(bench)
    health = (await bench.client.get(f"{bench.url}/health?verbose")).json()["services"]
    ids = [health[kind]["instances"][0] for kind in ("scheduler", "detokenizer", "tokenizer")]
    messages = nats_messages(*ids) * bench.config.nats_repeat
    clients = {kind: await connect_as(bench, kind) for kind in ("scheduler", "detokenizer", "tokenizer")}

    async def inject() -> None:
        for message in messages:
            nc = clients[message.sender]
            if message.request:
                try:
                    await nc.request(message.subject, message.payload, timeout=0.2)
                    tally.notes.append(f"{message.name}: answered")
                except nats.errors.Error:
                    pass  # dropped at the decoder: nobody answers
            else:
                await nc.publish(message.subject, message.payload, headers=message.headers)
        for nc in clients.values():
            await nc.flush()

    try:
        await requests_through(bench, tally, inject, bench.config.num_in_flight, bench.config.fault_tokens)
    finally:
        for nc in clients.values():
            await nc.close()
    same = service_pids(bench) == before
    if not same:
        tally.notes.append(f"a process was replaced: {before} -> {service_pids(bench)}")
    tally.faults_injected = len(messages)
    tally.faults_survived = len(messages) if same and await recovered(bench) else 0


async def connect_as(bench: Bench, kind: str) -> nats.aio.client.Client:
    """A NATS connection with the identity `up` gave that service (read from its environment,
    as any process of the same user could): hostile messages then come from a real identity,
    as from a compromised service, and the server's permissions apply to them."""
    environ = Path(f"/proc/{pid_of(bench, kind)}/environ").read_bytes().split(b"\0")
    values = dict(entry.decode(errors="replace").partition("=")[::2] for entry in environ if b"=" in entry)
    url = values.get("SPARKWIRE_NATS_URL") or _logged_nats_url(bench)
    user, password = values.get("SPARKWIRE_NATS_USER"), values.get("SPARKWIRE_NATS_PASSWORD")
    credentials = {"user": user, "password": password} if user else {}

    async def quiet(_exc: Exception) -> None:  # permission violations are the server refusing: expected
        return None

    return await nats.connect(url, error_cb=quiet, max_reconnect_attempts=3, **credentials)


def _logged_nats_url(bench: Bench) -> str:
    found = re.search(r"nats-server on (nats://\S+)", bench.log_path.read_text(errors="replace"))
    if found is None:
        raise RuntimeError("sparkwire up did not say where its nats-server listens")
    return found[1]


def kill_case(process: str) -> Callable[[Bench, Tally], Awaitable[None]]:
    async def case(bench: Bench, tally: Tally) -> None:
        async def kill() -> None:
            os.kill(pid_of(bench, process), signal.SIGKILL)

        await requests_through(bench, tally, kill, bench.config.num_in_flight, bench.config.fault_tokens)
        tally.faults_injected = 1
        tally.faults_survived = int(await recovered(bench))

    return case


async def concurrent(bench: Bench, tally: Tally) -> None:
    async def nothing() -> None:
        return None

    await requests_through(bench, tally, nothing, bench.config.num_concurrent, bench.config.max_new_tokens)


CASES: dict[str, Callable[[Bench, Tally], Awaitable[None]]] = {
    "hostile_http": hostile_http,
    "hostile_nats": hostile_nats,
    "kill_scheduler": kill_case("scheduler"),
    "kill_detokenizer": kill_case("detokenizer"),
    "kill_tokenizer": kill_case("tokenizer"),
    "restart_nats": kill_case("nats-server"),
    "concurrent": concurrent,
}


# ---- the run ----


async def run_cases(config: ReliabilityConfig, url: str, up_pid: int, log_path: Path) -> dict[str, Tally]:
    limits = httpx.Limits(max_connections=config.num_concurrent + 8, max_keepalive_connections=32)
    async with httpx.AsyncClient(timeout=httpx.Timeout(config.request_timeout_s), limits=limits) as client:
        bench = Bench(config, url, up_pid, log_path, client)
        for max_new_tokens in (config.max_new_tokens, config.fault_tokens):  # the right answers, on a quiet stack
            await bench.reference(max_new_tokens)
        tallies = {}
        for name in config.cases:
            tally = tallies[name] = Tally()
            began = time.monotonic()
            await CASES[name](bench, tally)
            tally.seconds = round(time.monotonic() - began, 2)
            print(f"reliability: {name}: {row(name, tally)}", flush=True)
        return tallies


def run(out: Path, config: ReliabilityConfig = ReliabilityConfig()) -> dict[str, Any]:
    url = f"http://127.0.0.1:{free_port()}"
    log_path = config.up_log or Path(tempfile.mkdtemp(prefix="sparkwire-reliability-")) / "up.log"
    with launched_stack(config.up_args, url, log_path) as stack:
        tallies = asyncio.run(run_cases(config, url, stack.up.process.pid, log_path))
    totals = {key: sum(getattr(t, key) for t in tallies.values()) for key in MUST_BE_ZERO}
    document = {
        "benchmark": "reliability",
        "config": {key: value for key, value in asdict(config).items() if key != "up_log"},
        "cases": {name: asdict(tally) for name, tally in tallies.items()},
        "must_be_zero": totals,
        "passed": all(value == 0 for value in totals.values()) and all(
            t.faults_survived == t.faults_injected for t in tallies.values()
        ),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(document, indent=2, default=str) + "\n")
    print(table(tallies))
    return document


COLUMNS = ("sent", "complete", "failed_clearly", "lost", "short", "server_errors", "faults_injected", "faults_survived")


def row(name: str, tally: Tally) -> str:
    return " | ".join([name, *(str(getattr(tally, column)) for column in COLUMNS), f"{tally.seconds:.1f}"])


def table(tallies: dict[str, Tally]) -> str:
    header = " | ".join(["case", *COLUMNS, "s"])
    lines = [header, " | ".join("---" for _ in range(len(COLUMNS) + 2))]
    lines += [row(name, tally) for name, tally in tallies.items()]
    return "\n".join(f"| {line} |" for line in lines)


def add_arguments(reliability: argparse.ArgumentParser) -> None:
    defaults = ReliabilityConfig()
    reliability.add_argument("--cases", nargs="+", choices=ALL_CASES, default=list(ALL_CASES))
    reliability.add_argument("--num-concurrent", type=int, default=defaults.num_concurrent)
    reliability.add_argument("--num-in-flight", type=int, default=defaults.num_in_flight, help="requests running at each fault")
    reliability.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens)
    reliability.add_argument("--fault-tokens", type=int, default=defaults.fault_tokens, help="tokens per request hit by a fault")
    reliability.add_argument("--up-args", default="", help='flags for the launched `sparkwire up`, e.g. --up-args="--device cpu"')
    reliability.add_argument("--up-log", type=Path, default=None)
    reliability.add_argument("--out", type=Path, default=RESULTS / "reliability.json")


def main(args: argparse.Namespace) -> int:
    config = ReliabilityConfig(
        cases=tuple(args.cases), num_concurrent=args.num_concurrent, num_in_flight=args.num_in_flight,
        max_new_tokens=args.max_new_tokens, fault_tokens=args.fault_tokens, up_args=tuple(shlex.split(args.up_args)),
        up_log=args.up_log,
    )  # fmt: skip
    return 0 if run(args.out, config)["passed"] else 1


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
