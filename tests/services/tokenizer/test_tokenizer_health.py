"""/health reflects every service kind the tokenizer depends on; ?verbose shows each one's state."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from contracts import subjects
from contracts.control import Heartbeat
from tests.services.tokenizer.conftest import DETOKENIZER_ID, SCHEDULER_ID

pytestmark = pytest.mark.timeout(60)


async def health_once_settled(client: httpx.AsyncClient, want: int) -> httpx.Response:
    """Heartbeats arrive every 0.1 s: poll until the status is the one expected (or give up)."""
    async with asyncio.timeout(10):
        while (response := await client.get("/health?verbose")).status_code != want:
            await asyncio.sleep(0.1)
    return response


async def test_health_is_200_only_while_a_detokenizer_is_alive_and_verbose_names_each_service(url, backend):
    async with httpx.AsyncClient(base_url=url) as client:
        healthy = (await health_once_settled(client, 200)).json()
        assert healthy["services"]["detokenizer"] == {"ok": True, "instances": [DETOKENIZER_ID]}
        assert healthy["services"]["scheduler"] == {"ok": True, "instances": [SCHEDULER_ID]}
        assert healthy["services"]["tokenizer"]["ok"] is True
        await backend.go_silent()
        backend.beating = asyncio.create_task(only_scheduler_beats(backend))  # the detokenizer is gone
        sick = (await health_once_settled(client, 503)).json()
        assert "detokenizer" in sick["error"]["message"]
        assert sick["services"]["detokenizer"] == {"ok": False, "instances": []}
        assert "services" not in (await client.get("/health")).json()


async def only_scheduler_beats(backend) -> None:
    while True:
        await backend.transport.publish(subjects.heartbeat("scheduler"), Heartbeat("scheduler", SCHEDULER_ID))
        await asyncio.sleep(0.1)
