"""Run the tokenizer: the NATS service and uvicorn serving the Litestar app on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import structlog
import uvicorn

from services.tokenizer.config import TokenizerConfig
from services.tokenizer.http_app import Frontend, create_app
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_model import TextModel

log = structlog.get_logger(__name__)


@contextlib.asynccontextmanager
async def serving(config: TokenizerConfig) -> AsyncIterator[Frontend]:
    """The whole tokenizer up (HTTP listening) inside the block; drained and stopped after it."""
    model = TextModel.from_dir(config.model_dir, config.max_model_len)
    service = await TokenizerService.start(config)
    frontend = Frontend(config, model, service)
    server = uvicorn.Server(
        uvicorn.Config(
            create_app(frontend), host=config.host, port=config.port, lifespan="on", log_level=config.log_level,
            timeout_graceful_shutdown=config.nats.drain_timeout_s,
        )  # fmt: skip
    )
    # uvicorn owns signals only when it runs the loop itself; here the caller owns them.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.02)
        log.info("tokenizer.listening", host=config.host, port=config.port, instance=config.instance_id)
        yield frontend
    finally:
        # Drain: uvicorn stops accepting connections and lets in-flight requests (streams too)
        # finish for up to `drain_timeout_s`, while the NATS side still serves them; then close it.
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, config.nats.drain_timeout_s + 5)
        await service.close()


async def run(config: TokenizerConfig, stop: asyncio.Event) -> None:
    async with serving(config):
        await stop.wait()
