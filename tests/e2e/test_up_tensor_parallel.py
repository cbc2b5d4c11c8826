"""`sparkwire up --tp 2 --device cpu`: one scheduler of two rank processes serves the bundled model;
a rank killed mid-stream fails that request with a clear error, `sparkwire up` restarts the
scheduler (group and all), and later requests succeed with the same greedy output."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import pytest

from e2e.stack import generate_body
from e2e.test_up import start_up, wait_for_line
from e2e.test_up_supervision import pid_of, wait_status
from services.common.nats_server import free_port
from services.models import BUNDLED_MODEL


def greedy(url: str) -> dict:
    response = httpx.post(f"{url}/generate", json=generate_body(max_new_tokens=8), timeout=60)
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.timeout(300)
def test_up_with_two_ranks_serves_and_survives_a_killed_rank(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process, log = start_up(tmp_path, port, "--tp", "2", "--device", "cpu")
    try:
        wait_for_line(process, log, f"Sparkwire ready on {url}", 180)
        before = greedy(url)
        assert before["meta_info"]["completion_tokens"] == 8 and before["text"]

        body = generate_body(max_new_tokens=4000)
        body["sampling_params"]["ignore_eos"] = True
        answer: dict = {}
        streaming = threading.Thread(target=lambda: answer.update(r=httpx.post(f"{url}/generate", json=body, timeout=120)))
        streaming.start()
        time.sleep(2.0)  # mid-stream
        os.kill(pid_of(process.pid, "--multiprocessing-fork"), signal.SIGKILL)  # rank 1, the scheduler's spawned child
        streaming.join(timeout=60)
        assert not streaming.is_alive(), "the request hung after its rank died"
        failed = answer["r"]
        text = failed.text
        assert failed.status_code >= 500 or failed.json()["meta_info"]["finish_reason"]["type"] == "abort", text
        assert "tensor-parallel rank 1 of 2 exited with code -9" in text, text

        wait_for_line(process, log, "scheduler restarted", 60)
        wait_status(url, 200, 120)
        after = greedy(url)
        assert (after["text"], after["output_ids"]) == (before["text"], before["output_ids"])
        # new weights would reach rank 0's shards only: refused in one line, the old ones keep serving
        update = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": str(BUNDLED_MODEL)}, timeout=60)
        assert update.status_code == 400 and "not supported yet" in update.text, update.text
        assert greedy(url)["output_ids"] == before["output_ids"]
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
