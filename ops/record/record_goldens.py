"""(Re)record the golden streams of tests/replay: `python ops/record/record_goldens.py`.

Starts a real stack on the random tiny model (CPU) with fixed instance ids, sends a fixed list of
HTTP cases one at a time while recording the scheduler's input (`GenerateRequest`s) and output
(`TokenBatch`es, raw, chunk headers included), and writes to tests/replay/goldens/:

    scheduler.swrec   the recording (only the scheduler's generate and token subjects)
    golden.json       instance ids, and per case: name, path, body, status, response

tests/replay/test_golden_replay.py replays the recorded token batches into a fresh detokenizer and
tokenizer (same instance ids) and compares their HTTP answers with these responses. Native cases
carry fixed rids; OpenAI endpoints make their own rids, which the replay maps by request content.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
from concurrent.futures import ThreadPoolExecutor
import urllib.request
from pathlib import Path
from typing import Any

from contracts import subjects
from services.common.nats_server import NatsServer, free_port, start_nats_server
from services.models import RANDOM_TINY_MODEL
from services.recorder.format import FORMAT_VERSION, MAGIC, RecordingHeader, RecordingWriter, read_recording
from services.recorder.golden import GoldenCase, GoldenResponse, parse_body, post_json, record_golden
from services.tokenizer.text_model import TextModel

ROOT = Path(__file__).resolve().parents[2]
GOLDENS = ROOT / "tests" / "replay" / "goldens"
SCHEDULER_ID, DETOKENIZER_ID, TOKENIZER_ID = "golden-sched", "golden-detok", "golden-tok"
DIRECT_SUBJECTS = f"{subjects.PREFIX}.*.*.*"  # <service>.<instance>.<kind>: no claims, no heartbeats
KEPT_SUBJECTS = (subjects.scheduler_generate(SCHEDULER_ID), subjects.detokenizer_tokens(DETOKENIZER_ID))
READY_TIMEOUT_S = 180.0
STOP_PROMPT = "The quick brown fox"
STOP_SAMPLING = {"max_new_tokens": 24, "temperature": 1.0, "seed": 7}  # varied text: a stop string mid-way
UTF8_PROMPT = "Grüße aus Köln: 你好, 世界 🙂 — naïve café"
UTF8_MAX_NEW_TOKENS = 32
UTF8_TEMPERATURE = 1.5
NUM_UTF8_SEEDS = 512  # a random-weight model rarely samples a valid multi-byte character
GREEDY = {"temperature": 0}


def generate(name: str, text: str, max_new_tokens: int = 12, sampling: dict[str, Any] | None = None, **extra: Any):
    params = {"max_new_tokens": max_new_tokens, **GREEDY, **(sampling or {})}
    return name, GoldenCase("/generate", {"text": text, "sampling_params": params, "rid": f"golden-{name}", **extra})


def cases(stop: str, utf8_seed: int) -> list[tuple[str, GoldenCase]]:
    """The recorded cases, sent one at a time (so each token batch holds one request)."""
    logprobs = {"return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": 3}
    utf8 = {"temperature": UTF8_TEMPERATURE, "seed": utf8_seed}
    return [
        generate("greedy", "def add(a, b):", 16),
        generate("stop_string", STOP_PROMPT, sampling={**STOP_SAMPLING, "stop": ["never-matches", stop]}),
        generate("logprobs", "Hello world", 8, token_ids_logprob=[1, 2, 3], return_text_in_logprobs=True, **logprobs),
        generate(
            "flat_b64", "import numpy as np\n", 6, return_logprob=True, logprob_start_len=0, top_logprobs_num=2,
            return_flat_raw_top_logprobs=True, return_flat_raw_top_logprobs_b64=True,
        ),
        generate("stream", "Once upon a time", 10, stream=True, return_logprob=True, top_logprobs_num=2),
        generate("utf8_stream", UTF8_PROMPT, UTF8_MAX_NEW_TOKENS, utf8, stream=True),
        generate("utf8", UTF8_PROMPT, UTF8_MAX_NEW_TOKENS, utf8, return_logprob=True, return_text_in_logprobs=True),
        ("completions_echo", GoldenCase(
            "/v1/completions", {"prompt": UTF8_PROMPT, "max_tokens": 8, "temperature": 0, "echo": True, "logprobs": 2}
        )),
        ("completions_stream", GoldenCase(
            "/v1/completions", {"prompt": "for i in range(", "max_tokens": 6, "temperature": 0, "stream": True, "logprobs": 1}
        )),
        ("chat_logprobs", GoldenCase("/v1/chat/completions", {
            "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 8, "temperature": 0,
            "logprobs": True, "top_logprobs": 2,
        })),
    ]


def service_argv(name: str, nats_url: str, instance_id: str, *extra: str) -> list[str]:
    # The committed goldens were recorded on the random tiny model, so every service loads it.
    return [sys.executable, "-m", "services.cli", name, "--nats-url", nats_url, "--instance-id", instance_id,
            "--model", str(RANDOM_TINY_MODEL), *extra]


def start_services(nats: NatsServer, port: int, log_dir: Path) -> list[subprocess.Popen[bytes]]:
    argvs = [
        service_argv("scheduler", nats.url, SCHEDULER_ID, "--device", "cpu"),
        service_argv("detokenizer", nats.url, DETOKENIZER_ID),
        service_argv("tokenizer", nats.url, TOKENIZER_ID, "--port", str(port)),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    processes = []
    for argv in argvs:
        with (log_dir / f"{argv[3]}.log").open("wb") as log:
            processes.append(subprocess.Popen(argv, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=log, stderr=log, env=env))
    return processes


def wait_healthy(url: str, processes: list[subprocess.Popen[bytes]], log_dir: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if any(p.poll() is not None for p in processes):
            raise RuntimeError(f"a service exited; logs in {log_dir}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise TimeoutError(f"{url}/health not 200 after {READY_TIMEOUT_S}s; logs in {log_dir}")


def stop_processes(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in reversed(processes):
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def probe(http_url: str, text: str, sampling: dict[str, Any]) -> dict[str, Any]:
    response = post_json(http_url + "/generate", {"text": text, "sampling_params": sampling}, 60)
    return json.loads(response.body)


def pick_stop_string(http_url: str) -> str:
    """A stop string first found in the middle of the (seeded) continuation: it cuts mid-stream."""
    text = probe(http_url, STOP_PROMPT, STOP_SAMPLING)["text"]
    for start in range(len(text) // 2, len(text) - 4):
        candidate = text[start : start + 4]
        if candidate.strip() and text.find(candidate) >= len(text) // 3:
            return candidate
    raise RuntimeError(f"no usable stop string in the probe output {text!r}")


def splits_a_character(output_ids: list[int], text: str, model: TextModel) -> bool:
    """A valid multi-byte character whose bytes no single output token holds: the detokenizer
    must hold its first bytes back until the rest arrives."""
    tokens = [model.token_bytes[i] for i in output_ids]
    wide = {c for c in text if ord(c) > 127 and c != "\ufffd"}
    return any(all(c.encode() not in token for token in tokens) for c in wide)


def pick_utf8_seed(http_url: str) -> int:
    model = TextModel.from_dir(RANDOM_TINY_MODEL)
    sampling = {"max_new_tokens": UTF8_MAX_NEW_TOKENS, "temperature": UTF8_TEMPERATURE}

    def split(seed: int) -> bool:
        out = probe(http_url, UTF8_PROMPT, {**sampling, "seed": seed})
        return splits_a_character(out["output_ids"], out["text"], model)

    with ThreadPoolExecutor(4) as pool:  # concurrent requests batch on the scheduler: same outputs, faster
        for first in range(0, NUM_UTF8_SEEDS, 32):
            seeds = range(first, first + 32)
            found = [seed for seed, hit in zip(seeds, pool.map(split, seeds)) if hit]
            if found:
                return found[0]
    raise RuntimeError(f"no seed below {NUM_UTF8_SEEDS} samples a character split across tokens")


def keep_scheduler_subjects(raw: Path, out: Path, nats_url: str) -> int:
    """Rewrite the recording with only the scheduler's input and output; returns the message count."""
    messages = [m for m in read_recording(raw).messages if m.subject in KEPT_SUBJECTS]
    with open(out, "wb") as stream:
        header = RecordingHeader(MAGIC, FORMAT_VERSION, time.time(), nats_url, " ".join(KEPT_SUBJECTS))
        writer = RecordingWriter(stream, header)
        for message in messages:
            writer.write(message)
    return len(messages)


def golden_entry(name: str, case: GoldenCase, response: GoldenResponse) -> dict[str, Any]:
    if response.status != 200:
        raise RuntimeError(f"case {name}: HTTP {response.status}: {response.body}")
    return {"name": name, "path": case.path, "body": case.body, "status": response.status, "response": parse_body(response)}


async def record_all(nats_url: str, http_url: str, out_dir: Path, work_dir: Path) -> None:
    named = cases(pick_stop_string(http_url), pick_utf8_seed(http_url))
    raw = work_dir / "all.swrec"
    responses, _ = await record_golden(nats_url, http_url, [c for _, c in named], raw, subject=DIRECT_SUBJECTS)
    count = keep_scheduler_subjects(raw, out_dir / "scheduler.swrec", nats_url)
    golden = {
        "scheduler_id": SCHEDULER_ID,
        "detokenizer_id": DETOKENIZER_ID,
        "tokenizer_id": TOKENIZER_ID,
        "recording": "scheduler.swrec",
        "cases": [golden_entry(name, case, response) for (name, case), response in zip(named, responses, strict=True)],
    }
    (out_dir / "golden.json").write_text(json.dumps(golden, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(named)} cases, {count} scheduler messages to {out_dir}")


def main() -> int:
    parser = argparse.ArgumentParser(prog="python ops/record/record_goldens.py", description=__doc__.split("\n")[0])
    parser.add_argument("--out-dir", type=Path, default=GOLDENS)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="sparkwire-goldens-") as work:
        work_dir = Path(work)
        nats, port = start_nats_server(), free_port()
        processes = start_services(nats, port, work_dir)
        http_url = f"http://127.0.0.1:{port}"
        try:
            wait_healthy(http_url, processes, work_dir)
            asyncio.run(record_all(nats.url, http_url, args.out_dir, work_dir))
        except BaseException:
            for log in sorted(work_dir.glob("*.log")):
                print(f"--- {log.name}\n" + "\n".join(log.read_text(errors="replace").splitlines()[-30:]), file=sys.stderr)
            raise
        finally:
            stop_processes(processes)
            nats.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
