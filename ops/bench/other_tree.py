"""A benchmark script run on another checkout's code (`--before DIR`), in the same run as this one.

Each tree runs its own copy of the script where it has one, so each tree's core is built by its
own `scheduler_harness` (the two trees' scheduler APIs may differ); a tree from before the script
existed runs this checkout's copy with its code first on the path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def script_in(tree: Path, script: str | Path) -> Path:
    """`tree`'s own copy of `script` (a file of this checkout) where it has one, else `script`."""
    script = Path(script).resolve()
    if not script.is_relative_to(REPO):
        return script
    theirs = tree / script.relative_to(REPO)
    return theirs if theirs.is_file() else script


def run_on_tree(script: str | Path, tree: Path, argv: list[str]) -> object:
    """`script` (tree's copy: `script_in`) in a subprocess with `tree` first on the path (before what
    PYTHONPATH held: packages installed beside the project) and as its working directory, so
    `services` and the rest come from `tree`; the JSON of its last line."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    command = [sys.executable, str(script_in(tree, script)), *argv]
    done = subprocess.run(command, env=env, cwd=tree, capture_output=True, text=True, check=True)
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
