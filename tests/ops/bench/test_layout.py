"""The rules that keep ops/bench usable: the scheduler reached through one module, every script
in the README's table and runnable from `sparkwire bench`, every cited path present, a short
results folder."""

from __future__ import annotations

import re

from ops.bench.__main__ import KERNEL_CHECKS, SUITES
from ops.bench.common import REPO, RESULTS

BENCH = REPO / "ops/bench"
# The scheduler modules whose API moves with the scheduler's refactor: scheduler_harness.py alone imports them.
MOVING = re.compile(r"^\s*(from|import) services\.scheduler(\.(core|policy|worker|request|service|config|flags|wire|host_io|__main__|"
                    r"spec\.dspark_loader|spec\.draft_graphs|spec\.accept)\b| import (core|policy|worker|request|service|config|"
                    r"flags|wire|host_io)\b)", re.MULTILINE)  # fmt: skip
CITED_PATH = re.compile(r"ops/bench/[A-Za-z0-9_./-]*[A-Za-z0-9_/]")
CITED_MODULE = re.compile(r"\bops\.bench\.([a-z0-9_]+)")
CITED_SUITE = re.compile(r"sparkwire bench ([a-z0-9-]+)(?: ([a-z0-9-]+))?")
MAX_RESULT_FILES = 40


def _docs() -> dict[str, str]:
    paths = [REPO / "README.md", BENCH / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    return {str(path.relative_to(REPO)): path.read_text(encoding="utf-8") for path in paths}


def test_only_the_harness_imports_the_schedulers_moving_modules():
    offenders = [path.name for path in BENCH.glob("*.py") if path.name != "scheduler_harness.py" and MOVING.search(path.read_text())]
    assert offenders == []
    assert MOVING.search((BENCH / "scheduler_harness.py").read_text())  # the pattern still finds what it is for


def test_every_path_module_and_command_the_docs_cite_exists():
    missing = []
    for doc, text in _docs().items():
        missing += [f"{doc}: {p}" for p in CITED_PATH.findall(text) if not (REPO / p.rstrip(".")).exists()]
        missing += [f"{doc}: ops.bench.{m}" for m in CITED_MODULE.findall(text) if not (BENCH / f"{m}.py").is_file()]
        for name, check in CITED_SUITE.findall(text):
            if name not in SUITES and name != "gpu-kernels" or name == "gpu-kernels" and check and check not in KERNEL_CHECKS:
                missing.append(f"{doc}: sparkwire bench {name} {check}".strip())
    assert missing == []


def test_the_readme_table_names_every_suite_and_every_file():
    readme = (BENCH / "README.md").read_text(encoding="utf-8")
    commands = [f"sparkwire bench {name}" for name in SUITES] + [f"sparkwire bench gpu-kernels {name}" for name in KERNEL_CHECKS]
    assert [command for command in commands if f"`{command}" not in readme] == []
    assert [path.name for path in BENCH.glob("*.py") if path.name != "__init__.py" and path.name not in readme] == []
    suite_files = {suite.module.rsplit(".", 1)[1] + ".py" for suite in [*SUITES.values(), *KERNEL_CHECKS.values()]}
    assert suite_files <= {path.name for path in BENCH.glob("*.py")}


def test_the_results_folder_stays_short():
    files = [path for path in RESULTS.rglob("*") if path.is_file()]
    assert len(files) <= MAX_RESULT_FILES, sorted(path.name for path in files)
