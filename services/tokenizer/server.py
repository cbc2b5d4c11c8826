"""Run the tokenizer: the NATS service and uvicorn serving the Litestar app on one asyncio loop."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket
from collections.abc import AsyncIterator

import structlog
import uvicorn

from services.common.memory import settle_startup_heap
from services.common.metrics import TrafficCollector
from services.common.metrics_shared import PUBLISH_INTERVAL_S, SharedMetricsDir
from services.tokenizer.config import TokenizerConfig
from services.tokenizer.frontend import request_left
from services.tokenizer.http_app import Frontend, create_asgi
from services.tokenizer.metrics import Metrics
from services.tokenizer.service import TokenizerService
from services.tokenizer.text_model import TextModel

log = structlog.get_logger(__name__)


@contextlib.asynccontextmanager
async def serving(config: TokenizerConfig) -> AsyncIterator[Frontend]:
    """The whole tokenizer up (HTTP listening) inside the block; drained and stopped after it."""
    model = TextModel.from_dir(config.model_dir, config.max_model_len, config.tokenizer_dir, config.chat_template)
    model.warm_logprob_tables()  # so that the first request with logprobs does not hold the event loop building them
    metrics = Metrics(config.model_name)
    service = await TokenizerService.start(config, functools.partial(request_left, metrics))
    metrics.registry.register(TrafficCollector(lambda: service.traffic))
    if config.metrics_dir is not None:
        config.metrics_dir.mkdir(parents=True, exist_ok=True)
        metrics.shared = SharedMetricsDir(metrics.registry, config.metrics_dir, config.instance_id)
    frontend = Frontend(config, model, service, metrics)
    # log_config=None: uvicorn keeps its hands off logging, so its lines go through ours
    # (JSON when asked, with the request id of the call they are about).
    server = uvicorn.Server(
        uvicorn.Config(
            create_asgi(frontend), host=config.host, port=config.port, lifespan="on", log_level=config.log_level,
            timeout_graceful_shutdown=config.nats.drain_timeout_s, log_config=None,
        )  # fmt: skip
    )
    # uvicorn owns signals only when it runs the loop itself; here the caller owns them.
    server.install_signal_handlers = lambda: None  # type: ignore[method-assign]
    sockets = [shared_listener(config.host, config.port)] if config.reuse_port else None
    task = asyncio.create_task(server.serve(sockets=sockets))
    publishing = asyncio.create_task(_publish_periodically(metrics.shared)) if metrics.shared is not None else None
    try:
        while not server.started:
            if task.done():
                task.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.02)
        log.info("tokenizer.listening", host=config.host, port=config.port, instance=config.instance_id)
        settle_startup_heap()
        yield frontend
    finally:
        # Drain: uvicorn stops accepting connections and lets in-flight requests (streams too)
        # finish for up to `drain_timeout_s`, while the NATS side still serves them; then close it.
        server.should_exit = True
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, config.nats.drain_timeout_s + 5)
        await service.close()
        if publishing is not None:
            publishing.cancel()
            with contextlib.suppress(OSError):
                metrics.shared.publish()  # its last counts stay in the sums after it has gone
            metrics.shared.close()


async def _publish_periodically(shared: SharedMetricsDir) -> None:
    """Between scrapes too, so a sibling's page lags this process's counts by one interval at most."""
    failing = False
    while True:
        await asyncio.sleep(PUBLISH_INTERVAL_S)
        try:
            shared.publish()
            failing = False
        except OSError as exc:  # a full or vanished directory: the page lags, serving goes on; said once
            if not failing:
                log.warning("metrics.publish_failed", error=str(exc))
            failing = True


def shared_listener(host: str, port: int) -> socket.socket:
    """A listening TCP socket with SO_REUSEPORT: every tokenizer that binds the same port this way
    gets its share of the new connections (the kernel spreads them), so `sparkwire up --tokenizers N`
    serves one port from N processes. uvicorn serves it as given (`Server.serve(sockets=...)`)."""
    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind(address)
    sock.listen(2048)
    return sock


async def run(config: TokenizerConfig, stop: asyncio.Event) -> None:
    async with serving(config):
        await stop.wait()
