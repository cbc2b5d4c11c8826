"""Repository rules that no single module test would catch."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

import pytest

from contracts import subjects
from services.models import BUNDLED_DRAFT_MODEL, BUNDLED_MODEL

ROOT = Path(__file__).resolve().parents[1]
FORBIDDEN_MODULES = {"pickle", "cloudpickle", "dill", "_pickle"}
MAX_TRACKED_BYTES = 10 * 1024 * 1024
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
BUNDLED_WEIGHTS = {f"{model.relative_to(ROOT).as_posix()}/model.safetensors" for model in (BUNDLED_MODEL, BUNDLED_DRAFT_MODEL)}


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
        elif isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) == "import_module":
            names |= {arg.value.split(".")[0] for arg in node.args if isinstance(arg, ast.Constant) and isinstance(arg.value, str)}
    return names


def python_files(*folders: str) -> list[Path]:
    return [path for folder in folders for path in sorted((ROOT / folder).rglob("*.py"))]


def test_no_pickle_anywhere_in_contracts_or_services():
    offenders = {str(path.relative_to(ROOT)): sorted(imported_modules(path) & FORBIDDEN_MODULES)
                 for path in python_files("contracts", "services")}  # fmt: skip
    assert {path: names for path, names in offenders.items() if names} == {}


def test_the_pickle_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import os\nfrom pickle import dumps\nimport importlib\nimportlib.import_module('dill')\n")
    assert imported_modules(bad) & FORBIDDEN_MODULES == {"pickle", "dill"}


def tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / name for name in out.decode().split("\0") if name]


def test_no_tracked_file_over_10_mb():
    files = tracked_files()
    assert files, "git ls-files listed nothing"
    too_big = {str(path.relative_to(ROOT)): path.stat().st_size for path in files
               if path.exists() and path.stat().st_size > MAX_TRACKED_BYTES}  # fmt: skip
    assert too_big == {}


def test_the_only_tracked_weights_are_the_bundled_pair():
    weights = {path.relative_to(ROOT).as_posix() for path in tracked_files() if path.suffix in WEIGHT_SUFFIXES}
    assert weights == BUNDLED_WEIGHTS


def test_the_bundled_pair_is_under_10_mb_together():
    pair = [path for path in tracked_files() if path.parent in (BUNDLED_MODEL, BUNDLED_DRAFT_MODEL)]
    assert any(path.suffix == ".safetensors" for path in pair)
    assert sum(path.stat().st_size for path in pair) <= MAX_TRACKED_BYTES


def test_every_subject_in_the_subjects_module_is_versioned():
    values = [value for name, value in vars(subjects).items()
              if name.isupper() and isinstance(value, str) and name not in ("VERSION", "PREFIX")
              and not name.endswith("_QUEUE")]  # fmt: skip
    values += [make("x") for make in (subjects.scheduler_generate, subjects.detokenizer_tokens,
                                      subjects.tokenizer_outputs, subjects.heartbeat)]  # fmt: skip
    assert values and all(value.startswith(f"sparkwire.{subjects.VERSION}.") for value in values), values


def test_subject_strings_are_only_spelled_in_the_subjects_module():
    """Services build subjects through `contracts.subjects`, never by hand."""
    offenders = [str(path.relative_to(ROOT)) for path in python_files("services")
                 if f"{subjects.PREFIX}." in path.read_text()]  # fmt: skip
    assert offenders == []


def test_the_quick_start_installs_what_sparkwire_up_needs():
    """`sparkwire up` runs a scheduler, whose torch and safetensors live in the `scheduler` extra:
    a quick start that installs only the base package would end in the scheduler's ImportError."""
    import re
    import tomllib

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    command = next(line for line in readme.splitlines() if "sparkwire up" in line and "pip install" in line)
    installs = re.findall(r"pip install (?:-e )?'?([^\s']+)'?", command)
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    assert "scheduler" in extras and any(target.startswith(".[") and "scheduler" in target for target in installs), command


# ---- the code's shape (issue 40): rooms a reader holds in their head ----

MAX_MODULE_LINES = 400  # services/scheduler and services/tokenizer
MAX_CLASS_METHODS = 20
MAX_CORE_ARGUMENTS = 5
LAYOUT_KINDS = {"token", "top_values", "top_ids", "ids"}  # the logprob layout's kinds (`LogprobColumns`, `RowLogprobs`)
LAYOUT_HOMES = {"contracts/logprobs.py": "LogprobColumns", "services/common/logprob_rows.py": "RowLogprobs"}


def _classes(path: Path) -> list[ast.ClassDef]:
    return [node for node in ast.walk(ast.parse(path.read_text(), filename=str(path))) if isinstance(node, ast.ClassDef)]


def _fields(node: ast.ClassDef) -> set[str]:
    return {item.target.id for item in node.body if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)}


def test_no_scheduler_or_tokenizer_module_is_over_400_lines():
    long = {str(p.relative_to(ROOT)): n for p in python_files("services/scheduler", "services/tokenizer")
            if (n := p.read_text().count("\n")) > MAX_MODULE_LINES}  # fmt: skip
    assert long == {}


def test_no_class_has_more_than_20_methods():
    crowded = {f"{p.relative_to(ROOT)}:{c.name}": n for p in python_files("contracts", "services") for c in _classes(p)
               if (n := sum(isinstance(i, ast.FunctionDef | ast.AsyncFunctionDef) for i in c.body)) > MAX_CLASS_METHODS}  # fmt: skip
    assert crowded == {}


def test_the_scheduler_core_is_built_from_at_most_5_arguments():
    from services.scheduler.core import SchedulerCore

    import inspect

    parameters = [p for p in inspect.signature(SchedulerCore.__init__).parameters if p != "self"]
    assert len(parameters) <= MAX_CORE_ARGUMENTS, parameters


def test_the_logprob_layout_is_declared_once_on_the_wire_and_once_as_a_requests_rows():
    """Only `LogprobColumns` (the wire) and `RowLogprobs` (one request's rows, host or device)
    declare the layout's kinds as fields: any other struct holding them is a second layout."""
    declaring = {f"{p.relative_to(ROOT).as_posix()}:{c.name}" for p in python_files("contracts", "services") for c in _classes(p)
                 if len(_fields(c) & LAYOUT_KINDS) >= 2}  # fmt: skip
    assert declaring == {f"{path}:{name}" for path, name in LAYOUT_HOMES.items()}


def test_the_layout_check_can_fail(tmp_path):
    second = tmp_path / "second.py"
    second.write_text("class Rows:\n    token: list\n    top_values: list\n    top_ids: list\n")
    assert len(_fields(_classes(second)[0]) & LAYOUT_KINDS) >= 2
