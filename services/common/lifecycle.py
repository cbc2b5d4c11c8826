"""Process lifecycle shared by the services: a stop event set by SIGINT/SIGTERM."""

from __future__ import annotations

import asyncio
import signal
import uuid


def new_instance_id() -> str:
    return uuid.uuid4().hex


def stop_on_signals(stop: asyncio.Event) -> None:
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
