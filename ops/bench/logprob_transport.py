"""`sparkwire bench logprob-transport`: prompt top logprobs, flat arrays vs nested rows.

For each size (rows x k) it measures, in one run on this machine:
- per hop: encode + decode of the message that carries the prompt top logprobs — nested rows
  (per position `null` or a list of `(logprob, token_id, text)` triples, SGLang's layout) against
  the flat arrays as `contracts.logprobs.LogprobColumns` carries them (float32/int32 `[rows, k]`);
- two hops over a real nats-server left at the default 1 MB `max_payload` (so large messages are
  chunked by `services.common.transport`): sender -> relay (its own process, decoding and
  re-encoding as the detokenizer does, `ops.bench.relay`) -> receiver (decode), wall time from
  before the first encode to after the last decode; the flat arrays on both event loops the
  services can run (uvloop, their default, and the standard library's asyncio);
- one hop of the flat arrays received two ways in the same run: `NatsReader` (what `Transport`
  uses) against a plain nats-py subscription (`ops.bench.natspy_receiver`, the baseline);
- response building in the tokenizer: JSON float/int lists, the b64 text as a Python str through
  `msgspec.json.encode` (the first version), and `json_body.encode_json` (what `/generate` uses);
- end to end over HTTP (131072 x 20 only): the real detokenizer and tokenizer services as
  processes, a stand-in scheduler (`ops.bench.standin_scheduler`) emitting the arrays through the
  scheduler's own message code, the same 131073-token prompt with prompt token logprobs, with and
  without flat b64 top-k, timed by `curl`; "added" is the difference of the median latencies.
  Measured with the services' defaults (uvloop, tuned allocator), then with asyncio's loop, then
  with glibc's default allocator thresholds (`HTTP_RUNTIMES`); the stand-in scheduler in this
  process keeps the defaults.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import nats
import numpy as np
import pybase64

from contracts.logprobs import LogprobColumns
from services.common.logprob_rows import RowLogprobs, to_columns
from ops.bench.common import RESULTS, script
from ops.bench.relay import HOP1, HOP2
from ops.bench.natspy_receiver import NatsPyReceiver
from ops.bench.standin_scheduler import StandInScheduler
from services.common.arrays import from_wire, to_wire
from services.common.lifecycle import EVENT_LOOPS, run_event_loop
from services.common.nats_server import PROJECT_CONFIG, free_port, start_nats_server
from services.common.transport import Transport
from services.tokenizer.json_body import Base64Field, encode_json

SIZES = ((32768, 2), (32768, 20), (131072, 20))


@dataclass(frozen=True)
class Runtime:
    """How the front-half services run in the HTTP measurement (`SPARKWIRE_EVENT_LOOP`, `_ALLOCATOR`)."""

    event_loop: str
    allocator: str

    @property
    def name(self) -> str:
        return f"{self.event_loop}+{self.allocator} allocator"


# The services' defaults first, then each alternative with one setting changed.
HTTP_RUNTIMES = (Runtime("uvloop", "tuned"), Runtime("asyncio", "tuned"), Runtime("uvloop", "default"))
ONE_HOP_NATS_PY, ONE_HOP_READER = "sparkwire.v1.bench.one_hop.nats_py", "sparkwire.v1.bench.one_hop.reader"
NULL_PREFIX = 1  # the first prompt position has no logprobs
Triple = tuple[float, int, None]


class NestedPromptTop(msgspec.Struct, array_like=True, gc=False):
    """The baseline layout: one Python row per prompt position."""

    rows: list[list[Triple] | None]


def make_arrays(rows: int, k: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    values = -np.sort(rng.exponential(2.0, size=(rows - NULL_PREFIX, k)).astype(np.float32), axis=1)  # [rows-1, k]
    ids = rng.integers(0, 151936, size=(rows - NULL_PREFIX, k), dtype=np.int32)  # [rows-1, k]
    return values, ids


def nested_message(values: np.ndarray, ids: np.ndarray) -> NestedPromptTop:
    rows: list[list[Triple] | None] = [None] * NULL_PREFIX
    rows += [list(zip(v, i, [None] * len(v))) for v, i in zip(values.tolist(), ids.tolist())]
    return NestedPromptTop(rows)


def flat_message(values: np.ndarray, ids: np.ndarray) -> LogprobColumns:
    return to_columns([RowLogprobs.of(None, values, ids, start=NULL_PREFIX)])


def median_ms(fn: Callable[[], Any], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def per_hop(message: msgspec.Struct, message_type: type, repeat: int) -> dict[str, float]:
    encoder, decoder = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(message_type)
    payload = encoder.encode(message)
    encode_ms = median_ms(lambda: encoder.encode_into(message, bytearray()), repeat)  # as the transport does
    decode_ms = median_ms(lambda: _touch(decoder.decode(payload)), repeat)
    return {"encode_ms": encode_ms, "decode_ms": decode_ms, "bytes": len(payload)}


def _touch(message: Any) -> None:
    """Decoding flat arrays must end in numpy views, as a real receiver would use them."""
    if isinstance(message, LogprobColumns):
        from_wire(message.top_values)
        from_wire(message.top_ids)


async def two_hops(url: str, message: msgspec.Struct, message_type: type, repeat: int, event_loop: str) -> float:
    """sender -> relay (its own process, like the detokenizer) -> receiver; median ms. The relay
    runs on `event_loop`, as does the caller."""
    layout = "flat" if message_type is LogprobColumns else "nested"
    relay = subprocess.Popen([sys.executable, "-m", "ops.bench.relay", url, layout, event_loop],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)  # fmt: skip
    sender, receiver = await Transport.connect(url, "sender"), await Transport.connect(url, "receiver")
    arrived: asyncio.Queue[float] = asyncio.Queue()

    async def land(decoded: Any, _msg: Any) -> None:
        _touch(decoded)
        arrived.put_nowait(time.perf_counter())

    await receiver.subscribe(HOP2, message_type, land)
    assert (await asyncio.to_thread(relay.stdout.readline)).strip() == b"ready"
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        await sender.publish(HOP1, message)
        times.append((await asyncio.wait_for(arrived.get(), 120) - start) * 1e3)
    relay.stdin.close()
    relay.wait(timeout=30)
    for transport in (sender, receiver):
        await transport.close()
    return statistics.median(times)


async def one_hop_readers(url: str, message: msgspec.Struct, repeat: int) -> dict[str, float]:
    """One hop, sender -> receiver in this process, received two ways in the same run: a plain
    nats-py subscription with reassembly (`natspy_receiver`, the baseline) and `Transport`'s
    `NatsReader`. Median ms from before the encode to after the decode."""
    sender = await Transport.connect(url, "bench-sender")
    arrived: asyncio.Queue[float] = asyncio.Queue()

    def land(decoded: Any, *_: Any) -> None:
        _touch(decoded)
        arrived.put_nowait(time.perf_counter())

    async def land_async(decoded: Any, _delivery: Any) -> None:
        land(decoded)

    nc = await nats.connect(url, name="bench-natspy-receiver")
    await NatsPyReceiver(nc, LogprobColumns, land).subscribe(ONE_HOP_NATS_PY)
    reader = await Transport.connect(url, "bench-reader-receiver")
    await reader.subscribe(ONE_HOP_READER, LogprobColumns, land_async)
    await reader.flush()
    result = {}
    for key, subject in (("nats_py_ms", ONE_HOP_NATS_PY), ("reader_ms", ONE_HOP_READER)):
        times = []
        for _ in range(repeat):
            start = time.perf_counter()
            await sender.publish(subject, message)
            times.append((await asyncio.wait_for(arrived.get(), 60) - start) * 1e3)
        result[key] = statistics.median(times)
    await nc.close()
    for transport in (sender, reader):
        await transport.close()
    return result


def response_building(values: np.ndarray, ids: np.ndarray, repeat: int) -> dict[str, float]:
    """The two flat fields to JSON bytes, three ways."""

    def as_lists() -> bytes:
        return msgspec.json.encode({"val": values.ravel().tolist(), "idx": ids.ravel().tolist()})

    def as_b64_str() -> bytes:
        little_values, little_ids = values.astype("<f4", copy=False), ids.astype("<i4", copy=False)
        return msgspec.json.encode(
            {"val": pybase64.b64encode_as_string(little_values), "idx": pybase64.b64encode_as_string(little_ids)}
        )

    def as_b64_fields() -> bytes:
        return encode_json({"val": Base64Field(values), "idx": Base64Field(ids)})

    assert as_b64_str() == as_b64_fields()
    return {"json_lists_ms": median_ms(as_lists, repeat), "b64_str_ms": median_ms(as_b64_str, repeat),
            "b64_ms": median_ms(as_b64_fields, repeat)}


def default_payload_config(directory: Path) -> Path:
    """The project config with `max_payload` back at the NATS default (1 MB)."""
    lines = [line for line in PROJECT_CONFIG.read_text().splitlines() if not line.startswith("max_payload")]
    config = directory / "nats-default-payload.conf"
    config.write_text("\n".join(lines + ["max_payload: 1MB"]) + "\n")
    return config


def bench_size(url: str, rows: int, k: int, repeat: int) -> dict[str, Any]:
    values, ids = make_arrays(rows, k)
    nested, flat = nested_message(values, ids), flat_message(values, ids)
    result: dict[str, Any] = {"rows": rows, "k": k}
    result["nested_hop"] = per_hop(nested, NestedPromptTop, max(3, repeat // 3))
    result["flat_hop"] = per_hop(flat, LogprobColumns, repeat)
    result["nested_two_hops_ms"] = run_event_loop(two_hops(url, nested, NestedPromptTop, 3, "uvloop"))
    for loop in EVENT_LOOPS:
        key = "flat_two_hops_ms" if loop == "uvloop" else f"flat_two_hops_{loop}_ms"
        result[key] = run_event_loop(two_hops(url, flat, LogprobColumns, repeat, loop), loop)
    result["flat_one_hop"] = run_event_loop(one_hop_readers(url, flat, repeat))
    result["response"] = response_building(values, ids, max(3, repeat // 3))
    hop = lambda key: result[key]["encode_ms"] + result[key]["decode_ms"]  # noqa: E731
    result["per_hop_speedup"] = hop("nested_hop") / hop("flat_hop")
    return result


def table(results: list[dict[str, Any]]) -> str:
    lines = [
        "| rows x k | nested hop enc+dec ms | flat hop enc+dec ms | speedup | bytes nested / flat | 2 hops nested ms"
        " | 2 hops flat ms (asyncio) | 1 hop flat, NatsReader / nats-py ms | JSON lists ms | b64 ms (as str) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        n, f, resp = r["nested_hop"], r["flat_hop"], r["response"]
        lines.append(
            f"| {r['rows']} x {r['k']} | {n['encode_ms']:.2f} + {n['decode_ms']:.2f} | {f['encode_ms']:.3f} + {f['decode_ms']:.3f}"
            f" | {r['per_hop_speedup']:.0f}x | {n['bytes'] / 1e6:.2f} / {f['bytes'] / 1e6:.2f} MB"
            f" | {r['nested_two_hops_ms']:.1f} | {r['flat_two_hops_ms']:.1f} ({r['flat_two_hops_asyncio_ms']:.1f})"
            f" | {r['flat_one_hop']['reader_ms']:.1f} / {r['flat_one_hop']['nats_py_ms']:.1f}"
            f" | {resp['json_lists_ms']:.1f} | {resp['b64_ms']:.1f} ({resp['b64_str_ms']:.1f}) |"
        )
    return "\n".join(lines)


def start_front_half(
    url: str, port: int, max_model_len: int, log_dir: Path, runtime: Runtime
) -> list[subprocess.Popen[bytes]]:
    """The real detokenizer and tokenizer services as processes, as `sparkwire <name>` runs them."""
    env = {**os.environ, "SPARKWIRE_EVENT_LOOP": runtime.event_loop, "SPARKWIRE_ALLOCATOR": runtime.allocator}
    argv = {
        "detokenizer": [],
        "tokenizer": ["--port", str(port), "--max-model-len", str(max_model_len), "--log-level", "warning"],
    }
    processes = []
    for name, extra in argv.items():
        log = (log_dir / f"{name}.log").open("wb")
        command = [sys.executable, "-m", "services.cli", name, "--nats-url", url, *extra]
        processes.append(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env))
    return processes


class ProcessMeter:
    """CPU time and minor page faults of some processes, from /proc (Linux)."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def read(self) -> dict[str, tuple[float, int]]:
        ticks = os.sysconf("SC_CLK_TCK")
        readings = {}
        for name, pid in self.pids.items():
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            readings[name] = ((int(fields[11]) + int(fields[12])) / ticks, int(fields[7]))  # utime+stime, minflt
        return readings

    @staticmethod
    def per_run(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]], runs: int) -> dict[str, Any]:
        return {name: {"cpu_ms": (after[name][0] - before[name][0]) * 1e3 / runs,
                       "page_faults": (after[name][1] - before[name][1]) // runs} for name in before}  # fmt: skip


async def http_end_to_end(
    url: str, nats_pid: int, rows: int, k: int, repeat: int, log_dir: Path, runtime: Runtime
) -> dict[str, Any]:
    """Median HTTP latency measured by curl (a separate process, so the client's own parsing of a
    28 MB body and the stand-in scheduler do not share one Python event loop), and per request
    the CPU time and page faults of each process on the path."""
    port = free_port()
    processes = start_front_half(url, port, rows + 8, log_dir, runtime)
    meter = ProcessMeter({"detokenizer": processes[0].pid, "tokenizer": processes[1].pid, "nats-server": nats_pid,
                          "stand-in scheduler": os.getpid()})  # fmt: skip
    transport = await Transport.connect(url, "bench-standin-scheduler")
    scheduler = StandInScheduler(transport, max_model_len=rows + 8)
    await scheduler.start()
    # Baseline: the same request with prompt token logprobs but no top-k, so the difference is
    # what the flat [rows, k] arrays cost end to end.
    base = {"input_ids": [3] + [5] * rows, "sampling_params": {"max_new_tokens": 1}, "return_logprob": True,
            "logprob_start_len": 0}
    flat = {**base, "top_logprobs_num": k, "return_flat_raw_top_logprobs": True,
            "return_flat_raw_top_logprobs_b64": True}
    endpoint = f"http://127.0.0.1:{port}/generate"
    try:
        await _wait_healthy(f"http://127.0.0.1:{port}/health")
        result: dict[str, Any] = {}
        for name, body in (("baseline", base), ("flat_b64", flat)):
            body_file = log_dir / f"{name}.json"
            body_file.write_bytes(msgspec.json.encode(body))
            await _curl(endpoint, body_file)  # warm-up
            before = meter.read()
            result[f"{name}_ms"] = await _median_curl_ms(endpoint, body_file, repeat)
            result[f"{name}_per_request"] = ProcessMeter.per_run(before, meter.read(), repeat)
    finally:
        await scheduler.stop()
        await transport.close()
        for process in processes:
            process.terminate()
            process.wait(timeout=20)
    result["added_ms"] = result["flat_b64_ms"] - result["baseline_ms"]
    return result


async def _wait_healthy(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (await _curl(url)).startswith("200"):
            return
        await asyncio.sleep(0.25)
    raise TimeoutError("the tokenizer did not become healthy")


async def _curl(url: str, body_file: Path | None = None) -> str:
    """`curl` prints '<status> <seconds>'; the body is discarded."""
    command = ["curl", "-s", "-o", "/dev/null", "-w", "%{http_code} %{time_total}", url]
    if body_file is not None:
        command += ["-H", "content-type: application/json", "--data-binary", f"@{body_file}"]
    done = await asyncio.to_thread(subprocess.run, command, capture_output=True, text=True)
    return done.stdout


async def _median_curl_ms(url: str, body_file: Path, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        status, seconds = (await _curl(url, body_file)).split()
        if status != "200":
            raise RuntimeError(f"{url} answered {status}")
        times.append(float(seconds) * 1e3)
    return statistics.median(times)


def run(
    out: Path, repeat: int = 9, sizes: tuple[tuple[int, int], ...] = SIZES, http_runtimes: tuple[Runtime, ...] = HTTP_RUNTIMES
) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as directory:
        server = start_nats_server(default_payload_config(Path(directory)))
        try:
            results = [bench_size(server.url, rows, k, repeat) for rows, k in sizes]
            rows, k = max(sizes)
            end_to_end = {
                runtime.name: run_event_loop(
                    http_end_to_end(server.url, server.process.pid, rows, k, max(3, repeat // 2), Path(directory), runtime),
                    runtime.event_loop,
                )
                for runtime in http_runtimes
            }
        finally:
            server.stop()
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"benchmark": "logprob-transport", "nats_max_payload": "1MB", "results": results,
                "http_end_to_end": {name: {"rows": rows, "k": k, **figures} for name, figures in end_to_end.items()}}
    out.write_text(json.dumps(document, indent=2))
    print(table(results))
    for name, figures in end_to_end.items():
        print(f"HTTP end to end, services on {name}, {rows} x {k} flat b64 vs the same request without top-k: "
              f"{figures['flat_b64_ms']:.1f} vs {figures['baseline_ms']:.1f} ms median, adds {figures['added_ms']:.1f} ms")
        for name in figures["flat_b64_per_request"]:
            flat, base = figures["flat_b64_per_request"][name], figures["baseline_per_request"][name]
            print(f"    {name}: CPU {flat['cpu_ms']:.1f} vs {base['cpu_ms']:.1f} ms, page faults {flat['page_faults']} vs "
                  f"{base['page_faults']} per request")
    print(f"results written to {out}")
    return results


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", type=Path, default=RESULTS / "logprob_transport.json")
    parser.add_argument("--repeat", type=int, default=9, help="timed repetitions per figure (median)")


def main(args: argparse.Namespace) -> int:
    run(args.out, repeat=args.repeat)
    return 0


if __name__ == "__main__":
    raise SystemExit(script(__doc__, add_arguments, main))
