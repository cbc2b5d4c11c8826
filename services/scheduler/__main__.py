"""`sparkwire scheduler ...` / `python -m services.scheduler ...`: one scheduler instance."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys

import structlog

from services.common.connection import add_connection_arguments, connection_from_args
from services.common.lifecycle import in_daemon_thread, leave, new_instance_id, run_service, stop_on_signals, unless_stopped
from services.common.logging import add_logging_arguments, configure_logging, with_progress
from services.common.model_source import refuse_remote_code, resolve_model
from services.common.settings import EnvSettings, connection_values
from services.scheduler.config import SchedulerConfig
from services.scheduler.core import SchedulerCore
from services.scheduler.flags import CUDA_SWITCHES, add_cuda_arguments, add_model_arguments, add_speculative_arguments
from services.scheduler.build import build_core, check_model
from services.scheduler.service import SchedulerService, connect

log = structlog.get_logger(__name__)
LOAD_ERRORS = (OSError, ValueError, KeyError)  # a bad model directory, an unsupported checkpoint


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = EnvSettings.from_environ()
    add_model_arguments(parser, env)
    add_speculative_arguments(parser)
    add_cuda_arguments(parser)
    parser.add_argument("--kv-block-size", type=int, default=16, help="tokens per paged KV block")
    parser.add_argument("--num-kv-blocks", type=int, default=None, help="default: sized from memory")
    parser.add_argument("--seed", type=int, default=0, help="seeds the draws of requests that bring no seed")
    add_logging_arguments(parser, env.log_level, env.log_format)
    add_connection_arguments(parser, connection_values())
    parser.add_argument("--instance-id", default=None, help="default: a random id")
    parser.add_argument("--metrics-host", default="127.0.0.1", help="bind address of --metrics-port")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")


def config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    refuse_remote_code(args.trust_remote_code)
    return SchedulerConfig(
        model=str(resolve_model(args.model, args.revision)),
        draft_model=args.draft_model,
        speculative_algorithm=args.speculative_algorithm,
        num_draft_tokens=args.speculative_num_draft_tokens,
        draft_context_window=args.draft_context_window,
        verify_mode=args.verify_mode,
        device=args.device,
        dtype=args.dtype,
        load_format=args.load_format,
        quantization=args.quantization,
        max_running_requests=args.max_running_requests,
        chunked_prefill_size=args.chunked_prefill_size,
        max_prefill_tokens=args.max_prefill_tokens,
        overlap_decode=args.overlap_decode,
        deterministic=args.deterministic,
        prefix_caching=args.prefix_caching,
        step_trace=args.step_trace,
        tensor_parallel_size=args.tensor_parallel_size,
        dense_attention=args.dense_attention,
        kv_block_size=args.kv_block_size,
        num_kv_blocks=args.num_kv_blocks,
        max_model_len=args.max_model_len,
        logprobs_mode=args.logprobs_mode,
        seed=args.seed,
        instance_id=args.instance_id or new_instance_id(),
        nats=connection_from_args(args, connection_values()),
        kv_cache_memory_fraction=args.kv_cache_memory_fraction,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
        **{name.replace("-", "_"): getattr(args, name.replace("-", "_")) for name in CUDA_SWITCHES},
    )


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ValueError as exc:
        print(f"sparkwire scheduler: {exc}", file=sys.stderr)
        return 2
    try:
        check_model(config)
    except LOAD_ERRORS as exc:
        return _cannot_load(config, exc)
    return leave(run_service(_serve(config)))


async def _serve(config: SchedulerConfig) -> int:
    """Connect, load, serve — in that order: a wrong password or an absent server fails before
    any weight is read. A SIGTERM while connecting or loading stops at once (0)."""
    stop = asyncio.Event()
    stop_on_signals(stop)
    transport = await unless_stopped(connect(config), stop)
    if transport is None:
        return _stopped_while_starting(config)
    async with contextlib.AsyncExitStack() as owned:
        owned.push_async_callback(transport.close)
        try:
            core = await unless_stopped(_load(config), stop)
        except LOAD_ERRORS as exc:
            return _cannot_load(config, exc)
        if core is None:
            return _stopped_while_starting(config)
        owned.pop_all()  # the service closes the transport from here on
    return await SchedulerService(config, core).run(transport, stop)


async def _load(config: SchedulerConfig) -> SchedulerCore:
    """In a daemon thread, which a stop abandons (`lifecycle.leave` then ends the process)."""
    return await with_progress("scheduler.load", in_daemon_thread(build_core, config), model=config.model)


def _cannot_load(config: SchedulerConfig, error: Exception) -> int:
    print(f"sparkwire scheduler: cannot load {config.model}: {error}", file=sys.stderr)
    return 2


def _stopped_while_starting(config: SchedulerConfig) -> int:
    log.info("scheduler.stopped", instance=config.instance_id, reason="stopped before the model was loaded")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sparkwire scheduler", description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
