"""Where a `--model` (or `--tokenizer`) comes from: a local path, or a Hugging Face model id.

Every service resolves its own `--model` here, so an id works wherever a directory does: the
scheduler needs the weights, the tokenizer and detokenizer only the tokenizer's files. An id
(`org/name`) is resolved by `huggingface_hub.snapshot_download`: from its cache when the files are
there (`HF_HOME`, `HF_HUB_CACHE`), downloading what is missing unless `HF_HUB_OFFLINE=1` (those
variables are huggingface_hub's own, read by it), at `--revision` (a branch, tag or commit; default
`main`). Only the files a service needs are fetched: safetensors weights, never `*.bin` pickles.
No code from a checkpoint ever runs here: `--trust-remote-code` is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

# Files of a model snapshot the services read: configs, tokenizer files, chat templates, weights.
TEXT_PATTERNS = ("*.json", "*.jinja", "*.model", "*.txt")
WEIGHT_PATTERNS = ("*.safetensors", "*.safetensors.index.json")
REMOTE_CODE_REFUSAL = (
    "--trust-remote-code is not supported: Sparkwire runs no code shipped with a checkpoint; it serves the "
    "architectures it implements (services/scheduler/model/registry.py) and refuses the others"
)


class ModelSourceError(ValueError):
    """A `--model` / `--tokenizer` that is neither a local path nor a model id the hub resolves."""


def add_source_arguments(parser: argparse.ArgumentParser, tokenizer: bool = False) -> None:
    """--revision and --trust-remote-code (every service that takes --model); tokenizer: --tokenizer too."""
    add = parser.add_argument
    add("--revision", default=None, help="with a Hugging Face model id as --model: its branch, tag or commit (default main)")
    add("--trust-remote-code", action="store_true", help="refused: no code shipped with a checkpoint runs here")
    if tokenizer:
        add("--tokenizer", default=None, help="tokenizer directory or model id, instead of --model's tokenizer files")


def source_argv(args: argparse.Namespace, service: str) -> list[str]:
    """The flags above as `sparkwire up` hands them to one of its services."""
    argv = ["--revision", args.revision] if args.revision else []
    if service in ("tokenizer", "detokenizer") and args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    return argv


def refuse_remote_code(trust_remote_code: bool) -> None:
    if trust_remote_code:
        raise ModelSourceError(REMOTE_CODE_REFUSAL)


def resolve_model(source: str | Path, revision: str | None = None, weights: bool = True) -> Path:
    """A local path as it is; a model id as its snapshot directory (weights False: without them)."""
    path = Path(source).expanduser()
    if path.exists():
        if revision:
            raise ModelSourceError(f"--revision {revision} applies to a model id; {source} is a local path")
        return path
    if not is_model_id(str(source)):
        raise ModelSourceError(f"cannot load {source}: no such file or directory, and not a Hugging Face model id (org/name)")
    return _snapshot(str(source), revision, weights)


def is_model_id(source: str) -> bool:
    """`name` or `org/name`: no further slashes, not a path that starts with one or with a dot."""
    parts = source.split("/")
    return 1 <= len(parts) <= 2 and all(parts) and not source.startswith((".", "~"))


def served_name(source: str | Path) -> str:
    """The model name clients see by default: a model id itself, else "" (the directory's name)."""
    return "" if Path(source).expanduser().exists() else str(source)


def _snapshot(model_id: str, revision: str | None, weights: bool) -> Path:
    from huggingface_hub import snapshot_download

    patterns = [*TEXT_PATTERNS, *(WEIGHT_PATTERNS if weights else ())]
    try:
        return Path(snapshot_download(model_id, revision=revision, allow_patterns=patterns))
    except (OSError, ValueError) as exc:  # not found, offline without a cached copy, a bad id or revision
        at = f" at revision {revision}" if revision else ""
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelSourceError(f"cannot load model id {model_id!r}{at} (no local path has that name either): {reason}") from None
