"""`sparkwire bench ...` run in the test's process, through the console script's own parser."""

from __future__ import annotations

from services.cli import main


def bench(*argv: object) -> int:
    """The exit code of `sparkwire bench ARGV` (the suite's module is imported by the parse, as the CLI does)."""
    return main(["bench", *map(str, argv)])
