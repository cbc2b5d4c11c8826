"""`sparkwire detokenizer`: CLI wiring for one detokenizer service."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.common.connection import add_connection_arguments, connection_from_args
from services.common.lifecycle import new_instance_id, run_service, stop_on_signals
from services.common.logging import add_logging_arguments, configure_logging
from services.common.model_source import add_source_arguments, refuse_remote_code, resolve_model
from services.common.settings import EnvSettings, connection_values
from services.detokenizer.config import DetokenizerConfig, tokenizer_file
from services.detokenizer.service import run
from services.models import BUNDLED_MODEL



def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = EnvSettings.from_environ()
    parser.add_argument("--model", default=env.model or str(BUNDLED_MODEL),
                        help="model directory, tokenizer.json or Hugging Face model id")  # fmt: skip
    add_source_arguments(parser, tokenizer=True)
    parser.add_argument("--instance-id", default=new_instance_id(), help="fixed id, e.g. to replay a recording")
    add_logging_arguments(parser, env.log_level, env.log_format)
    add_connection_arguments(parser, connection_values())
    parser.add_argument("--metrics-host", default="127.0.0.1", help="bind address of --metrics-port")
    parser.add_argument("--metrics-port", type=int, default=None, help="serve Prometheus /metrics here (0: any free port)")


def _text_source(args: argparse.Namespace) -> Path:
    """--tokenizer, else --model (at --revision), resolved without weights."""
    refuse_remote_code(args.trust_remote_code)
    if args.tokenizer:
        return resolve_model(args.tokenizer, weights=False)
    return resolve_model(args.model, args.revision, weights=False)


def config_from_args(args: argparse.Namespace) -> DetokenizerConfig:
    return DetokenizerConfig(
        nats=connection_from_args(args, connection_values()),
        tokenizer_path=tokenizer_file(_text_source(args)),
        instance_id=args.instance_id,
        metrics_host=args.metrics_host,
        metrics_port=args.metrics_port,
    )


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        config = config_from_args(args)
    except ValueError as exc:  # e.g. a --model without tokenizer.json: one line, no traceback
        print(f"sparkwire detokenizer: {exc}", file=sys.stderr)
        return 2

    async def serve() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        await run(config, stop)

    run_service(serve())
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sparkwire detokenizer")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
