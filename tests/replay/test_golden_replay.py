"""PRODUCT §8: the front half against recorded scheduler output, without a model.

A real nats-server, detokenizer and tokenizer (processes, the recorded instance ids) and a stand-in
scheduler that publishes the recorded `TokenBatch`es (tests/replay/goldens/scheduler.swrec) for
each request; every HTTP answer must equal its golden response, volatile fields aside.
Re-record with `python ops/record/record_goldens.py`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from contracts.detokenizer import TokenBatch
from e2e.stack import Service, health_status, service_argv
from replay.replay_scheduler import BackgroundLoop, Parts, ReplayScheduler, load_requests, payload, with_rid
from services.common.arrays import from_wire, to_wire
from services.common.nats_server import NatsServer, free_port, start_nats_server
from services.models import RANDOM_TINY_MODEL
from services.recorder.golden import GoldenResponse, fold_stream, normalise, parse_body

GOLDENS = Path(__file__).resolve().parent / "goldens"
GOLDEN = json.loads((GOLDENS / "golden.json").read_text())
CASES = {case["name"]: case for case in GOLDEN["cases"]}
READY_TIMEOUT_S = 30.0
HTTP_TIMEOUT_S = 10.0


@dataclass
class FrontHalf:
    nats: NatsServer
    services: list[Service]
    loop: BackgroundLoop
    scheduler: ReplayScheduler
    base_url: str

    def logs(self) -> str:
        return "\n".join(service.log_tail() for service in self.services)


def wait_healthy(front: FrontHalf) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while health_status(front.base_url) != 200:
        dead = [s for s in front.services if s.process.poll() is not None]
        if dead or time.monotonic() > deadline:
            raise RuntimeError(f"front half not healthy\n{front.logs()}")
        time.sleep(0.2)


@pytest.fixture(scope="module")
def front(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FrontHalf]:
    log_dir, nats_server, port = tmp_path_factory.mktemp("replay-logs"), start_nats_server(), free_port()
    model = ("--model", str(RANDOM_TINY_MODEL))  # the goldens were recorded on it
    detok = ("--instance-id", GOLDEN["detokenizer_id"], *model)
    tok = ("--instance-id", GOLDEN["tokenizer_id"], "--port", str(port), *model)
    services = [
        Service.start("detokenizer", service_argv("detokenizer", nats_server.url, *detok), log_dir),
        Service.start("tokenizer", service_argv("tokenizer", nats_server.url, *tok), log_dir),
    ]
    loop = BackgroundLoop()
    recording = GOLDENS / GOLDEN["recording"]
    start = ReplayScheduler.start(nats_server.url, recording, GOLDEN["scheduler_id"], GOLDEN["detokenizer_id"])
    front = FrontHalf(nats_server, services, loop, loop.run(start), f"http://127.0.0.1:{port}")
    try:
        wait_healthy(front)
        yield front
    finally:
        loop.run(front.scheduler.stop())
        loop.close()
        for service in reversed(services):
            service.stop()
        nats_server.stop()


def post(front: FrontHalf, case: dict[str, Any]) -> tuple[int, Any]:
    response = httpx.post(front.base_url + case["path"], json=case["body"], timeout=HTTP_TIMEOUT_S)
    return response.status_code, parse_body(GoldenResponse(response.status_code, response.text))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("name", list(CASES))
def test_replayed_response_equals_golden(front: FrontHalf, name: str) -> None:
    case = CASES[name]
    status, body = post(front, case)
    assert front.scheduler.unmatched == [], "requests with no recorded stream"
    assert status == case["status"], body
    assert comparable(body) == comparable(case["response"])


def comparable(body: Any) -> Any:
    """A response as the comparison sees it: volatile fields blanked; a stream's events folded
    (the tokenizer merges steps its reader has not taken yet: how they group depends on timing)."""
    return normalise(fold_stream(body) if isinstance(body, list) else body)


def bump_first_token(batches: list[Parts]) -> list[Parts]:
    """The first output token id changed: what a wrong token stream looks like."""
    index = next(i for i, parts in enumerate(batches) if decode(parts).new_token_ids.shape[0] > 0)
    batch = decode(batches[index])
    ids = from_wire(batch.new_token_ids).copy()  # int32 [num_new_tokens]
    ids[0] = (ids[0] + 1) % 256
    changed = msgspec.structs.replace(batch, new_token_ids=to_wire(ids))
    message = msgspec.structs.replace(batches[index][0], data=msgspec.msgpack.encode(changed), headers=None)
    return [*batches[:index], [message], *batches[index + 1 :]]


def decode(parts: Parts) -> TokenBatch:
    return msgspec.msgpack.decode(payload(parts), type=TokenBatch)


@pytest.mark.timeout(30)
def test_corrupted_token_stream_breaks_the_comparison(front: FrontHalf) -> None:
    """The comparison is not vacuous: one changed token id changes the answer."""
    case = CASES["greedy"]
    front.scheduler.rewrite = bump_first_token  # (recorded rids are the tokenizer's wire rids, not the body's)
    try:
        _, body = post(front, case)
    finally:
        front.scheduler.rewrite = None
    golden = case["response"]
    assert body["output_ids"][1:] == golden["output_ids"][1:]
    assert body["output_ids"][0] != golden["output_ids"][0]
    assert comparable(body) != comparable(golden)


def test_openai_rid_swap_keeps_sizes_and_headers() -> None:
    recorded = load_requests(GOLDENS / GOLDEN["recording"], GOLDEN["scheduler_id"], GOLDEN["detokenizer_id"])
    openai = recorded[-1]  # a chat completion's (every recorded rid is a tokenizer's wire rid, `<request id>-<nonce>-<choice>`)
    parts = openai.batches[0]
    new_rid = "f" * (len(openai.rid) - 2) + "-0"
    swapped = with_rid(parts, openai.rid, new_rid)
    assert [len(p.data) for p in swapped] == [len(p.data) for p in parts]
    assert [p.headers for p in swapped] == [p.headers for p in parts]
    assert decode(swapped).rids == [new_rid]
    shorter = with_rid(parts, openai.rid, "cmpl-short")  # live rids may differ in length
    assert [p.headers for p in shorter] == [p.headers for p in parts]
    assert decode(shorter).rids == ["cmpl-short"]
