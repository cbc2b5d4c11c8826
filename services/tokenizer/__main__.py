"""`sparkwire tokenizer`: the HTTP front end as one process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import services
from services.common.connection import add_connection_arguments, connection_from_args
from services.common.lifecycle import new_instance_id, run_service, stop_on_signals
from services.common.logging import configure_logging
from services.common.settings import EnvSettings, connection_values
from services.tokenizer.config import TokenizerConfig

BUNDLED_MODEL = Path(services.__file__).resolve().parents[1] / "ops" / "models" / "sparkwire-tiny"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = EnvSettings.from_environ()
    parser.add_argument("--log-level", default=env.log_level)
    parser.add_argument("--instance-id", default=None, help="default: a random uuid hex")
    parser.add_argument("--model", type=Path, default=Path(env.model) if env.model else BUNDLED_MODEL)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default="")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--max-logprobs", type=int, default=20)
    parser.add_argument("--request-timeout-s", type=float, default=5.0)
    add_connection_arguments(parser, connection_values())


def build_config(args: argparse.Namespace) -> TokenizerConfig:
    return TokenizerConfig(
        model_dir=args.model,
        nats=connection_from_args(args, connection_values()),
        instance_id=args.instance_id or new_instance_id(),
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        request_timeout_s=args.request_timeout_s,
        log_level=args.log_level,
    )


async def _serve(args: argparse.Namespace) -> None:
    from services.tokenizer.server import run

    stop = asyncio.Event()
    stop_on_signals(stop)
    await run(build_config(args), stop)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    run_service(_serve(args))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sparkwire tokenizer")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
