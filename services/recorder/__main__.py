"""`sparkwire record` and `sparkwire replay`: CLI wiring."""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

from contracts import subjects
from services.common.connection import add_connection_arguments, connection_from_args
from services.common.lifecycle import run_service, stop_on_signals
from services.common.logging import configure_logging
from services.common.settings import EnvSettings, connection_values
from services.recorder.config import RecordConfig, ReplayConfig
from services.recorder.record import record
from services.recorder.replay import ReplayStats, replay

PROGRESS_INTERVAL_S = 1.0
READY_PREFIX = "recording "  # the line `record` prints once it is subscribed (`sparkwire up --record` waits for it)


def _add_common(parser: argparse.ArgumentParser) -> None:
    env = EnvSettings.from_environ()
    add_connection_arguments(parser, connection_values())
    parser.add_argument("--log-level", default=env.log_level)


def add_record_arguments(parser: argparse.ArgumentParser) -> None:
    _add_common(parser)
    parser.add_argument("--out", required=True, type=Path, help="recording file to write")
    parser.add_argument("--subject", default=subjects.ALL, help="NATS subject pattern to record")
    parser.add_argument("--duration", type=float, default=None, help="stop after this many seconds")


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", type=Path, help="recording written by `sparkwire record`")
    _add_common(parser)
    parser.add_argument("--timing", choices=("fast", "original"), default="fast")
    parser.add_argument("--only-subject", default=None, help="replay only subjects matching this pattern")


def record_main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    config = RecordConfig(nats=connection_from_args(args, connection_values()), out=args.out, subject=args.subject, duration_s=args.duration)

    async def run() -> None:
        stop = asyncio.Event()
        stop_on_signals(stop)
        ready = asyncio.Event()
        task = asyncio.create_task(record(config.nats, config.out, config.subject, config.duration_s, stop, ready))
        ready_wait = asyncio.create_task(ready.wait())
        await asyncio.wait({task, ready_wait}, return_when=asyncio.FIRST_COMPLETED)  # task fails: no hang
        ready_wait.cancel()
        if ready.is_set():
            print(f"{READY_PREFIX}{config.subject} from {config.nats.redacted_url} to {config.out} (Ctrl-C stops)", file=sys.stderr, flush=True)
        stats = await task
        print(f"recorded {stats.num_messages} messages, {stats.num_bytes} bytes to {config.out}")

    run_service(run())
    return 0


def replay_main(args: argparse.Namespace) -> int:
    configure_logging(args.log_level)
    config = ReplayConfig(nats=connection_from_args(args, connection_values()), path=args.file, timing=args.timing, only_subject=args.only_subject)
    progress = _Progress()
    replaying = replay(config.nats, config.path, config.timing, config.only_subject, progress)
    stats = run_service(replaying)
    print(f"replayed {stats.num_messages} messages, {stats.num_bytes} bytes ({stats.num_skipped} skipped)")
    return 0


class _Progress:
    """Prints a progress line at most once per second, for long recordings."""

    def __init__(self) -> None:
        self._last = time.monotonic()

    def __call__(self, stats: ReplayStats) -> None:
        now = time.monotonic()
        if now - self._last >= PROGRESS_INTERVAL_S:
            self._last = now
            print(f"replayed {stats.num_messages} messages, {stats.num_bytes} bytes...", file=sys.stderr)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m services.recorder")
    commands = parser.add_subparsers(dest="command", required=True)
    add_record_arguments(commands.add_parser("record"))
    add_replay_arguments(commands.add_parser("replay"))
    parsed = parser.parse_args()
    sys.exit(record_main(parsed) if parsed.command == "record" else replay_main(parsed))
