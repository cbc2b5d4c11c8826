"""The NATS server restarting under a running stack (own stack: this test kills the server).

Every service holds two connections (nats-py for publishing, `NatsReader` for subscriptions);
both must come back, re-subscribe, and serve the same greedy output as before.
"""

from __future__ import annotations

import pytest

from e2e.stack import generate
from services.common.nats_server import start_nats_server


@pytest.mark.timeout(120)
def test_the_stack_serves_again_after_the_nats_server_restarts(stack):
    before = generate(stack)
    port = stack.nats.port
    stack.nats.kill()
    stack.nats = start_nats_server(port=port)
    stack.wait_healthy(timeout_s=30)
    after = generate(stack)
    assert (after["text"], after["output_ids"]) == (before["text"], before["output_ids"])
    stack.raise_if_dead()
    logs = stack.logs()
    assert "nats_reader.reconnected" in logs  # the readers, not only nats-py, came back
