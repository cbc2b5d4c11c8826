"""`sparkwire`: the one console script. Only this module (and the `add_arguments` functions it
calls) parses arguments.

Service subcommands import their package lazily, inside the subcommand, so `sparkwire --help`
and `sparkwire up --help` keep working even while one service fails to import.
"""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from services.common.connection import add_connection_arguments
from services.common.logging import add_logging_arguments
from services.common.settings import EnvSettings, connection_values

SERVICES = ("tokenizer", "scheduler", "detokenizer")
SCHEDULER_PACKAGES = ("torch", "safetensors", "tqdm")  # the `scheduler` extra of pyproject.toml
# What the README's install sections pin and where PyTorch keeps its CPU-only build (PyPI's Linux
# build is the CUDA one).
TORCH_REQUIREMENT = "torch==2.13.0"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
CHECKOUT = Path(__file__).resolve().parents[1]  # the repository, when installed from one with `pip install -e`


def install_commands(python: str = sys.executable, checkout: Path = CHECKOUT) -> dict[str, str]:
    """The README's install steps for the scheduler, as commands for the Python running this
    (`<python> -m pip`): the package is not on PyPI, so the extra comes from the checkout."""
    pip = f"{shlex.quote(python)} -m pip install"
    if (checkout / "pyproject.toml").is_file():
        source = f"-e {shlex.quote(f'{checkout}[scheduler]')}"
    else:  # installed from a wheel: the user names where it came from
        source = shlex.quote("<the sparkwire wheel or checkout>[scheduler]")
    return {
        "CPU only": f"{pip} {TORCH_REQUIREMENT} --index-url {TORCH_CPU_INDEX}",
        "NVIDIA GPU": f"{pip} {TORCH_REQUIREMENT}",
        "then": f"{pip} {source}",
    }


def scheduler_install_hint() -> str:
    steps = "\n".join(f"  {label}: {command}" for label, command in install_commands().items())
    return f"install the scheduler's packages (README.md, Install; the tokenizer and detokenizer run without them):\n{steps}"


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
        "services.recorder.__main__", "add_record_arguments", "record_main", "record every sparkwire.v2 message to a file"
    ),
    "replay": Command(
        "services.recorder.__main__", "add_replay_arguments", "replay_main", "publish a recorded file back to NATS"
    ),
    "bench": Command("ops.bench.__main__", "add_arguments", "main", "benchmarks (PRODUCT.md section 9)"),
    "push-weights": Command("services.weights.__main__", "add_arguments", "main", "push new weights to every scheduler over NATS"),
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
        if exc.name not in SCHEDULER_PACKAGES:
            raise
        raise SystemExit(f"sparkwire: {command.module} needs {exc.name}; {scheduler_install_hint()}") from None
    return getattr(module, attribute)


def _add_up(sub: argparse._SubParsersAction) -> None:
    from services import launcher  # light module: no torch, no service imports

    parser = sub.add_parser("up", help="run the whole stack on this machine", description=launcher.__doc__)
    add_up_arguments(parser)
    parser.set_defaults(run=launcher.main)


def add_up_arguments(parser: argparse.ArgumentParser) -> None:
    from services.scheduler.flags import add_cuda_arguments, add_model_arguments, add_speculative_arguments  # light: no torch

    env = EnvSettings.from_environ()
    add_connection_arguments(parser, connection_values())  # --nats-url empty: start an embedded nats-server
    add = parser.add_argument
    add_model_arguments(parser, env)
    add_speculative_arguments(parser)
    add_cuda_arguments(parser)
    add("--served-model-name", default="", help="the model name clients send and see (default: the model id, or the directory name)")
    add("--tokenizer", default=None, help="tokenizer directory or model id, instead of --model's tokenizer files")
    add("--chat-template", type=Path, default=None, metavar="FILE", help="a jinja chat template instead of the tokenizer's")
    add("--max-logprobs", type=int, default=20, help="largest top-k a request may ask for")
    add("--api-key", default=env.api_key or None,
        help="require `Authorization: Bearer KEY` on every route but /health (better: SPARKWIRE_API_KEY)")  # fmt: skip
    add("--host", default="127.0.0.1", help="HTTP bind address")
    add("--port", type=int, default=8000, help="HTTP port")
    add("--tokenizers", type=int, default=None,
        help="tokenizer (HTTP front end) processes sharing --port (SO_REUSEPORT, Linux); default where the scheduler "
             "serves on a GPU: one per 4 usable cores, 2 to 4 (one front end cannot keep up with a GPU's top-20 "
             "streams, and bursts queue at one), else 1")  # fmt: skip
    add_logging_arguments(parser, env.log_level, env.log_format)
    add("--ready-timeout-s", type=float, default=300.0, help="give up if /health is not 200 by then")
    add("--grace-s", type=float, default=10.0, help="wait this long after SIGTERM before SIGKILL")
    add("--record", type=Path, default=None, metavar="FILE",
        help="record every sparkwire.v2 message of the stack to FILE (`sparkwire replay FILE` plays it back)")

def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
