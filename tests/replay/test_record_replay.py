"""`record` + `replay` round trip over a real nats-server."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import signal
from pathlib import Path

import msgspec
import nats
import pytest

from contracts.control import Heartbeat
from contracts.subjects import PREFIX
from services.common.framing import CHUNK_HEADER, MSG_HEADER
from services.common.transport import Transport
from services.recorder.format import FORMAT_VERSION, MAGIC, RecordingError, read_recording
from services.recorder.record import record
from services.recorder.replay import ReplayError, replay, subject_matches

BIG_SUBJECT = f"{PREFIX}.detokenizer.abc.tokens"


class Blob(msgspec.Struct):
    data: bytes


async def record_while(url: str, out: Path, publish) -> None:
    """Run `record` around `await publish()`, stopping once everything published is recorded."""
    stop, ready = asyncio.Event(), asyncio.Event()
    task = asyncio.create_task(record(url, out, stop=stop, ready=ready))
    await asyncio.wait_for(ready.wait(), 10)
    await publish()
    await asyncio.sleep(0.3)  # the recorder's drain delivers what reached it; this lets it reach it
    stop.set()
    return await asyncio.wait_for(task, 20)


async def publish_sample(url: str) -> bytes:
    """Small messages with and without headers, one 3 MiB message chunked by the transport,
    and one message outside the project's subjects that must not be recorded."""
    sender = await Transport.connect(url, "sender")
    nc = sender._nc  # one connection: NATS orders messages per connection only
    big = bytes(range(256)) * (3 * 4096)
    await sender.publish(f"{PREFIX}.heartbeat.x", Heartbeat("x", "1"))
    await nc.publish(f"{PREFIX}.custom", b"plain", headers={"K": "v", "Other": "w"})
    await sender.publish(BIG_SUBJECT, Blob(big))
    await nc.publish("elsewhere.topic", b"ignored")
    await sender.publish(f"{PREFIX}.heartbeat.x", Heartbeat("x", "2"))
    await nc.flush()
    await sender.close()
    return big


@pytest.mark.timeout(60)
async def test_record_then_replay_round_trip(nats_server_factory, tmp_path):
    server = nats_server_factory(max_payload="1MB")
    out = tmp_path / "run.swrec"
    holder = {}

    async def publish() -> None:
        holder["big"] = await publish_sample(server.url)

    stats = await record_while(server.url, out, publish)
    recording = read_recording(out)
    assert (recording.header.magic, recording.header.version) == (MAGIC, FORMAT_VERSION)
    messages = recording.messages
    chunks = [m for m in messages if m.subject == BIG_SUBJECT]
    assert len(chunks) == 4  # 3 MiB under a 1 MB limit
    assert [m.headers[CHUNK_HEADER] for m in chunks] == [f"{i}/4" for i in range(4)]
    assert len({m.headers[MSG_HEADER] for m in chunks}) == 1
    subjects_in_order = [m.subject for m in messages]
    assert subjects_in_order == [f"{PREFIX}.heartbeat.x", f"{PREFIX}.custom"] + [BIG_SUBJECT] * 4 + [
        f"{PREFIX}.heartbeat.x"
    ]
    assert messages[1].headers == {"K": "v", "Other": "w"} and messages[1].data == b"plain"
    assert stats.num_messages == len(messages) == 7
    assert stats.num_bytes == sum(len(m.data) for m in messages)
    times = [m.received_at for m in messages]
    assert times == sorted(times)

    # Replay into a fresh server: raw messages come back identical and in order, and the
    # chunked message reassembles through the normal transport.
    target = nats_server_factory(max_payload="1MB")
    raw: list = []
    reassembled: asyncio.Queue[bytes] = asyncio.Queue()
    watcher = await nats.connect(target.url)

    async def on_raw(msg) -> None:
        raw.append((msg.subject, msg.headers, msg.data))

    async def on_blob(blob: Blob, _msg) -> None:
        reassembled.put_nowait(blob.data)

    await watcher.subscribe(f"{PREFIX}.>", cb=on_raw)
    receiver = await Transport.connect(target.url, "receiver")
    await receiver.subscribe(BIG_SUBJECT, Blob, on_blob)
    await watcher.flush()
    await receiver.flush()
    replayed = await replay(target.url, out)
    assert replayed.num_messages == 7
    assert await asyncio.wait_for(reassembled.get(), 10) == holder["big"]
    await watcher.flush()
    await asyncio.sleep(0.2)
    assert raw == [(m.subject, m.headers, m.data) for m in messages]
    await watcher.close()
    await receiver.close()


@pytest.mark.timeout(30)
async def test_replay_only_subject_and_original_timing(nats_server, tmp_path):
    out = tmp_path / "timed.swrec"

    async def publish() -> None:
        nc = await nats.connect(nats_server.url)
        await nc.publish(f"{PREFIX}.a.one", b"1")
        await nc.flush()
        await asyncio.sleep(0.4)
        await nc.publish(f"{PREFIX}.b.two", b"2")
        await nc.publish(f"{PREFIX}.a.three", b"3")
        await nc.flush()
        await nc.close()

    await record_while(nats_server.url, out, publish)
    got: list[tuple[float, bytes]] = []
    watcher = await nats.connect(nats_server.url)

    async def on_msg(msg) -> None:
        got.append((asyncio.get_running_loop().time(), msg.data))

    await watcher.subscribe(f"{PREFIX}.>", cb=on_msg)
    await watcher.flush()
    stats = await replay(nats_server.url, out, timing="original", only_subject=f"{PREFIX}.a.*")
    await watcher.flush()
    await asyncio.sleep(0.1)
    assert (stats.num_messages, stats.num_skipped) == (2, 1)
    assert [data for _, data in got] == [b"1", b"3"]
    assert got[1][0] - got[0][0] >= 0.3  # original spacing kept
    await watcher.close()


async def test_replay_refuses_messages_over_target_max_payload(nats_server_factory, tmp_path):
    source = nats_server_factory(max_payload="4MB")
    out = tmp_path / "big.swrec"

    async def publish() -> None:
        nc = await nats.connect(source.url)
        await nc.publish(f"{PREFIX}.big", b"x" * (2 * 1024 * 1024))
        await nc.flush()
        await nc.close()

    await record_while(source.url, out, publish)
    target = nats_server_factory(max_payload="1MB")
    with pytest.raises(ReplayError, match="max_payload"):
        await replay(target.url, out)


def test_truncated_recording_reads_up_to_last_whole_message(tmp_path):
    from services.recorder.format import RecordedMessage, RecordingHeader, RecordingWriter

    path = tmp_path / "cut.swrec"
    with open(path, "wb") as stream:
        writer = RecordingWriter(stream, RecordingHeader(MAGIC, FORMAT_VERSION, 0.0, "nats://x", ">"))
        for index in range(3):
            writer.write(RecordedMessage(f"s.{index}", None, float(index), b"data" * index))
    path.write_bytes(path.read_bytes()[:-3])
    assert [m.subject for m in read_recording(path).messages] == ["s.0", "s.1"]
    (tmp_path / "junk").write_bytes(b"\x05\x00\x00\x00hello")
    with pytest.raises(RecordingError):
        read_recording(tmp_path / "junk")


@pytest.mark.parametrize(
    ("pattern", "subject", "expected"),
    [
        (f"{PREFIX}.>", f"{PREFIX}.a.b", True),
        (f"{PREFIX}.>", PREFIX, False),
        ("sparkwire.*.a", f"{PREFIX}.a", True),
        ("sparkwire.*.a", f"{PREFIX}.a.b", False),
        (f"{PREFIX}.a", f"{PREFIX}.a", True),
        (f"{PREFIX}.a", f"{PREFIX}.b", False),
    ],
)
def test_subject_matches(pattern, subject, expected):
    assert subject_matches(pattern, subject) is expected


@pytest.mark.timeout(30)
def test_record_cli_stops_on_sigint_and_reports(nats_server, tmp_path):
    out = tmp_path / "cli.swrec"
    command = [sys.executable, "-m", "services.recorder", "record", "--nats-url", nats_server.url, "--out", str(out)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert "recording" in process.stderr.readline()
        asyncio.run(_publish_two(nats_server.url))
    finally:
        process.send_signal(signal.SIGINT)
        stdout, _ = process.communicate(timeout=10)
    assert process.returncode == 0
    assert "recorded 2 messages, 6 bytes" in stdout
    assert [m.data for m in read_recording(out).messages] == [b"one", b"two"]


async def _publish_two(url: str) -> None:
    nc = await nats.connect(url)
    await nc.publish(f"{PREFIX}.x", b"one")
    await nc.publish(f"{PREFIX}.y", b"two")
    await nc.flush()
    await nc.close()
    await asyncio.sleep(0.2)


@pytest.mark.timeout(30)
async def test_record_golden_records_while_posting(nats_server, tmp_path):
    """A stand-in HTTP front end that publishes one message per request, as a tokenizer would."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from services.recorder.golden import GoldenCase, record_golden

    loop = asyncio.get_running_loop()
    nc = await nats.connect(nats_server.url)

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers["Content-Length"]))
            asyncio.run_coroutine_threadsafe(nc.publish(f"{PREFIX}.test.seen", body), loop).result(5)
            asyncio.run_coroutine_threadsafe(nc.flush(), loop).result(5)
            reply = json.dumps({"echo": json.loads(body)}).encode()
            self.send_response(404 if self.path == "/missing" else 200)
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args) -> None:
            pass

    server = HTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    cases = [GoldenCase("/generate", {"text": "a"}), GoldenCase("/missing", {"text": "b"})]
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        responses, stats = await record_golden(nats_server.url, url, cases, tmp_path / "g.swrec", settle_s=0.2)
    finally:
        server.shutdown()
        await nc.close()
    assert [r.status for r in responses] == [200, 404]
    assert json.loads(responses[0].body) == {"echo": {"text": "a"}}
    assert stats.num_messages == 2
    assert [m.data for m in read_recording(tmp_path / "g.swrec").messages] == [b'{"text": "a"}', b'{"text": "b"}']
