"""`sparkwire`: the one console script. Only this module (and the `add_arguments` functions it
calls) parses arguments.

Service subcommands import their package lazily, inside the subcommand, so `sparkwire --help`
and `sparkwire up --help` keep working even while one service fails to import.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import services
from services.common.connection import add_connection_arguments
from services.common.settings import EnvSettings, connection_values

SERVICES = ("tokenizer", "scheduler", "detokenizer")
TORCH_HINT = "pip install 'sparkwire[scheduler]' (the tokenizer and detokenizer run without it)"
BUNDLED_MODEL = Path(services.__file__).resolve().parents[1] / "ops" / "models" / "sparkwire-tiny"


@dataclass(frozen=True)
class Command:
    """A subcommand whose arguments and entry point live in another module (imported lazily)."""

    module: str
    add_arguments: str
    main: str
    help: str


COMMANDS: dict[str, Command] = {
    **{
        name: Command(f"services.{name}.__main__", "add_arguments", "main", f"run one {name} service")
        for name in SERVICES
    },
    "record": Command(
        "services.recorder.__main__", "add_record_arguments", "record_main", "record every sparkwire.v1 message to a file"
    ),
    "replay": Command(
        "services.recorder.__main__", "add_replay_arguments", "replay_main", "publish a recorded file back to NATS"
    ),
    "bench": Command("ops.bench.__main__", "add_arguments", "main", "benchmarks (PRODUCT.md section 9)"),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The whole CLI. Only the subcommand named in `argv` imports its module (lazy)."""
    parser = argparse.ArgumentParser(prog="sparkwire", description="Serve a causal LM over NATS-connected services.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    selected = _selected_command(argv)
    for name, command in COMMANDS.items():
        sub_parser = sub.add_parser(name, help=command.help, description=command.help)
        if name == selected:
            _resolve(command, command.add_arguments)(sub_parser)
            sub_parser.set_defaults(run=_resolve(command, command.main))
        else:
            sub_parser.add_argument("rest", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    _add_up(sub)
    return parser


def _selected_command(argv: Sequence[str]) -> str | None:
    return next((arg for arg in argv if not arg.startswith("-")), None)


def _resolve(command: Command, attribute: str) -> Callable[..., object]:
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise SystemExit(f"sparkwire: {command.module} needs torch: {TORCH_HINT}") from None
    return getattr(module, attribute)


def _add_up(sub: argparse._SubParsersAction) -> None:
    from services import launcher  # light module: no torch, no service imports

    parser = sub.add_parser("up", help="run the whole stack on this machine", description=launcher.__doc__)
    add_up_arguments(parser)
    parser.set_defaults(run=launcher.main)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    from services.scheduler.flags import add_speculative_arguments  # light: no torch

    env = EnvSettings.from_environ()
    add_connection_arguments(parser, connection_values())  # --nats-url empty: start an embedded nats-server
    parser.add_argument("--model", default=env.model or str(BUNDLED_MODEL), help="target model directory")
    add_speculative_arguments(parser)
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default=env.device)
    parser.add_argument("--load-format", choices=("auto", "dummy"), default="auto")
    parser.add_argument("--logprobs-mode", choices=("raw", "processed"), default="raw",
                        help="raw: logprobs of the model's own distribution; processed: after temperature")
    parser.add_argument("--chunked-prefill-size", type=int, default=2048, help="tokens per scheduler step")
    parser.add_argument("--max-logprobs", type=int, default=20, help="largest top-k a request may ask for")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--log-level", default=env.log_level)
    parser.add_argument("--ready-timeout-s", type=float, default=300.0, help="give up if /health is not 200 by then")
    parser.add_argument("--grace-s", type=float, default=10.0, help="wait this long after SIGTERM before SIGKILL")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
