"""`sparkwire tokenizer`: the HTTP front end as one process."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from services.common.connection import add_connection_arguments, connection_from_args
from services.common.lifecycle import new_instance_id, run_service, stop_on_signals
from services.common.logging import add_logging_arguments, configure_logging
from services.common.model_source import add_source_arguments, refuse_remote_code, resolve_model, served_name
from services.common.settings import EnvSettings, connection_values
from services.models import BUNDLED_MODEL
from services.tokenizer.config import TokenizerConfig



def add_arguments(parser: argparse.ArgumentParser) -> None:
    env = EnvSettings.from_environ()
    add = parser.add_argument
    add_logging_arguments(parser, env.log_level, env.log_format)
    add("--instance-id", default=None, help="default: a random uuid hex")
    add("--model", default=env.model or str(BUNDLED_MODEL),
        help="model directory (tokenizer.json, tokenizer_config.json, config.json) or Hugging Face model id")  # fmt: skip
    add_source_arguments(parser, tokenizer=True)
    add("--chat-template", type=Path, default=None, metavar="FILE", help="a jinja chat template instead of the tokenizer's")
    add("--host", default="127.0.0.1", help="HTTP bind address")
    add("--port", type=int, default=8000, help="HTTP port")
    add("--reuse-port", action="store_true",
        help="listen with SO_REUSEPORT, so several tokenizers share --port (Linux spreads the connections over them)")  # fmt: skip
    add("--served-model-name", default="", help="the model name clients send and see (default: the model id, or the directory name)")
    add("--max-model-len", type=int, default=None, help="longest prompt + output (default: the model's)")
    add("--max-logprobs", type=int, default=20, help="largest top-k a request may ask for")
    add("--request-timeout-s", type=float, default=5.0, help="NATS request/reply timeout (claims, registration)")
    add("--claim-wait-s", type=float, default=30.0,
        help="every scheduler busy this long: the request goes to one anyway (load-aware placement)")
    add("--api-key", default=env.api_key or None,
        help="require `Authorization: Bearer KEY` on every route but /health (env: SPARKWIRE_API_KEY)")  # fmt: skip
    add("--metrics-require-api-key", action="store_true", help="/metrics needs the API key too")
    add("--metrics-dir", type=Path, default=None,
        help="a directory every tokenizer behind the same port writes its counts to; /metrics then answers their sum "
             "(sparkwire up sets it; in compose a shared volume)")  # fmt: skip
    add_connection_arguments(parser, connection_values())


def build_config(args: argparse.Namespace) -> TokenizerConfig:
    refuse_remote_code(args.trust_remote_code)
    return TokenizerConfig(
        model_dir=resolve_model(args.model, args.revision, weights=False),
        tokenizer_dir=resolve_model(args.tokenizer, weights=False) if args.tokenizer else None,
        chat_template=_read_template(args.chat_template),
        nats=connection_from_args(args, connection_values()),
        instance_id=args.instance_id or new_instance_id(),
        host=args.host,
        port=args.port,
        reuse_port=args.reuse_port,
        served_model_name=args.served_model_name or served_name(args.model),
        max_model_len=args.max_model_len,
        max_logprobs=args.max_logprobs,
        request_timeout_s=args.request_timeout_s,
        claim_wait_s=args.claim_wait_s,
        log_level=args.log_level,
        api_key=args.api_key,
        metrics_require_api_key=args.metrics_require_api_key,
        metrics_dir=args.metrics_dir,
    )


def _read_template(path: Path | None) -> str | None:
    if path is None:
        return None
    if not path.is_file():
        raise ValueError(f"--chat-template {path}: no such file")
    return path.read_text(encoding="utf-8")


async def _serve(config: TokenizerConfig) -> None:
    from services.tokenizer.server import run

    stop = asyncio.Event()
    stop_on_signals(stop)
    await run(config, stop)


def main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level, args.log_format)
    try:
        config = build_config(args)
    except ValueError as exc:  # e.g. a --model directory without tokenizer.json: one line, no traceback
        print(f"sparkwire tokenizer: {exc}", file=sys.stderr)
        return 2
    run_service(_serve(config))
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="sparkwire tokenizer")
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
