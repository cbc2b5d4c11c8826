"""A benchmark script run on another checkout's code (`--before DIR`), in the same run as this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def run_on_tree(script: str | Path, tree: Path, argv: list[str]) -> object:
    """`script` (this checkout's file) in a subprocess with `tree` first on the path (before what
    PYTHONPATH held: packages installed beside the project) and as its working directory, so
    `services` and the rest come from `tree`; the JSON of its last line."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, str(script), *argv], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def alternate(script: str | Path, trees: dict[str, Path], argv: list[str], rounds: int, last_round_extra: Sequence[str] = ()) -> dict[str, list]:
    """`script` run on each of `trees` in turn (in the dict's order), `rounds` times, so every tree
    sees the same load; each run with `--print-json` (the script prints its result as its last
    line), the last round with `last_round_extra` too. Tree name -> its results, in round order."""
    runs: dict[str, list] = {name: [] for name in trees}
    for index in range(rounds):
        extra = list(last_round_extra) if index == rounds - 1 else []
        for name, tree in trees.items():
            runs[name].append(run_on_tree(script, tree, [*argv, *extra, "--print-json"]))
    return runs
