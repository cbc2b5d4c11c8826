"""`sparkwire bench`: every suite is a subcommand, `--help` lists them without importing one (no
torch), and each suite's own flags parse through the console script."""

from __future__ import annotations

import subprocess
import sys

import pytest

from ops.bench.__main__ import KERNEL_CHECKS, SUITES
from ops.bench.common import REPO
from tests.ops.bench.bench_cli import bench

COMMANDS = [(name,) for name in SUITES] + [("gpu-kernels", name) for name in KERNEL_CHECKS]
PROBE = """
import sys
from services.cli import main
try:
    main(["bench", "--help"])
except SystemExit as exit:
    assert exit.code == 0, exit.code
suites = sorted(name for name in sys.modules if name.startswith("ops.bench.") and name != "ops.bench.__main__")
print("torch" in sys.modules, suites)
"""


def test_the_list_of_suites_imports_none_of_them():
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.strip().splitlines()[-1] == "False []"
    assert all(name in done.stdout for name in [*SUITES, "gpu-kernels"])


@pytest.mark.parametrize("command", COMMANDS, ids=" ".join)
def test_each_suite_parses_its_own_flags(command, capsys):
    with pytest.raises(SystemExit) as exit:
        bench(*command, "--help")
    assert exit.value.code == 0
    assert f"usage: sparkwire bench {' '.join(command)}" in capsys.readouterr().out.replace("\n", " ")


def test_python_dash_m_ops_bench_is_the_same_command():
    done = subprocess.run([sys.executable, "-m", "ops.bench", "gpu-kernels", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)  # fmt: skip
    assert all(name in done.stdout for name in KERNEL_CHECKS)
