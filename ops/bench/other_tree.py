"""A benchmark script run on another checkout's code (`--before DIR`), in the same run as this one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_on_tree(script: str | Path, tree: Path, argv: list[str]) -> object:
    """`script` (this checkout's file) in a subprocess with `tree` first on the path (before what
    PYTHONPATH held: packages installed beside the project) and as its working directory, so
    `services` and the rest come from `tree`; the JSON of its last line."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, (str(tree), os.environ.get("PYTHONPATH"))))}
    done = subprocess.run([sys.executable, str(script), *argv], env=env, cwd=tree, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])
