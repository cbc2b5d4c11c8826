"""The README's CPU-only install, followed literally in a fresh venv, and the commands the
missing-torch message names.

"Literally" here: every command line of the README's **CPU only** block, in order, run by bash
exactly as written, in a fresh copy of the checkout (its tracked and untracked files, no venv), so
`.venv` is created from nothing and every `pip install` resolves every dependency itself: no
`--no-deps`, no system site-packages, nothing installed beforehand. Three things differ from a
user's terminal, none of them in what ends up installed:

- `PIP_RETRIES=0`. Where download.pytorch.org cannot be reached (CI machines reach only PyPI or a
  mirror of it), pip would retry every lookup there five times before taking the CPU build from
  wherever the machine's pip configuration points. The test checks that the torch it ends with
  is the CPU-only 2.13.0, not where it came from.
- The last line, `sparkwire up ...`, gets `--port <a free port>` (8000 may be taken on a shared
  machine), runs until it has answered one /generate, and is stopped with Ctrl-C (SIGINT).
- pip's cache (~/.cache/pip) is used, as on any machine that installed something before.

Between `pip install -e .` and torch, `sparkwire up` must refuse with the install hint; its
commands are the README's (for the venv's own Python) and they run once torch is there.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from services.common.nats_server import free_port

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
STEP_TIMEOUT_S = 600

pytestmark = [pytest.mark.install, pytest.mark.timeout(1500)]


def readme_block(title: str) -> list[str]:
    """The command lines of the first ```bash block after the paragraph starting with `title`."""
    text = README.read_text(encoding="utf-8")
    block = text[text.index(f"\n{title}") :].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def fresh_checkout(destination: Path) -> Path:
    """What a clone of the working tree holds: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def user_environ() -> dict[str, str]:
    """Ours, without the venv that runs the tests: a user's shell has none active."""
    ours = Path(sys.prefix) / "bin"
    path = os.pathsep.join(p for p in os.environ.get("PATH", "").split(os.pathsep) if Path(p) != ours)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    return env | {"PATH": path, "PIP_RETRIES": "0", "PYTHONUNBUFFERED": "1"}


@dataclass
class Shell:
    cwd: Path
    env: dict[str, str]

    def run(self, line: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["bash", "-c", line], cwd=self.cwd, env=self.env, capture_output=True, text=True,
                              timeout=STEP_TIMEOUT_S)  # fmt: skip

    def ok(self, line: str) -> str:
        result = self.run(line)
        assert result.returncode == 0, f"$ {line}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        return result.stdout


def hint_commands(output: str) -> dict[str, str]:
    """`  <label>: <command>` lines of the install hint."""
    return dict(re.findall(r"^  (CPU only|NVIDIA GPU|then): (.+)$", output, flags=re.MULTILINE))


def as_readme_line(command: str, shell: Shell) -> str:
    """A hint command as the README spells it: `.venv/bin/pip` for the venv's `python -m pip`, `.` for the checkout."""
    venv_python = re.escape(str(shell.cwd / ".venv" / "bin" / "python")) + r"(3(\.\d+)?)?"
    pip = re.sub(rf"^'?{venv_python}'? -m pip ", ".venv/bin/pip ", command)
    return pip.replace(str(shell.cwd.resolve()), ".")


@dataclass(frozen=True)
class Installed:
    shell: Shell
    up_line: str
    hint: dict[str, str]


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    lines = readme_block("**CPU only**")
    shell = Shell(fresh_checkout(tmp_path_factory.mktemp("checkout")), user_environ())
    *setup, up_line = lines
    assert up_line.startswith(".venv/bin/sparkwire up"), lines
    hint: dict[str, str] = {}
    for line in setup:
        if "torch" in line and not hint:  # the project is in, torch not yet: `up` must say how to go on
            refused = shell.run(f"{up_line} --port {free_port()}")
            assert refused.returncode == 1, refused.stdout + refused.stderr
            hint = hint_commands(refused.stdout + refused.stderr)
        shell.ok(line)
    return Installed(shell, up_line, hint)


def test_the_readme_s_cpu_install_ends_with_torch_s_cpu_build(installed):
    build = installed.shell.ok(".venv/bin/python -c 'import torch; print(torch.__version__, torch.version.cuda)'")
    assert build.split() == ["2.13.0+cpu", "None"]


def test_the_installed_stack_serves_a_request_and_stops_on_ctrl_c(installed, tmp_path):
    port, log = free_port(), tmp_path / "up.log"
    with log.open("w") as out:
        up = subprocess.Popen(["bash", "-c", f"{installed.up_line} --port {port}"], cwd=installed.shell.cwd,
                              env=installed.shell.env, stdout=out, stderr=subprocess.STDOUT)  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while f"Sparkwire ready on http://127.0.0.1:{port}" not in log.read_text():
            assert up.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.5)
        body = {"text": "def add(a, b):", "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=body, timeout=60)
        assert response.status_code == 200 and response.json()["meta_info"]["completion_tokens"] == 4
        up.send_signal(signal.SIGINT)
        assert up.wait(timeout=60) == 0, log.read_text()[-4000:]
    finally:
        if up.poll() is None:
            up.kill()


def test_the_missing_torch_hint_names_the_readme_s_commands_and_they_run(installed):
    readme = readme_block("**CPU only**") + readme_block("**NVIDIA GPU (CUDA)**")
    assert set(installed.hint) == {"CPU only", "NVIDIA GPU", "then"}, installed.hint
    for command in installed.hint.values():
        assert as_readme_line(command, installed.shell) in readme, command
    for command in installed.hint.values():  # torch is in by now: each must run, and leave a working install
        installed.shell.ok(command)
    installed.shell.ok(".venv/bin/python -c 'import torch, safetensors, tqdm; import services.scheduler.__main__'")


def test_an_older_python_is_refused_before_torch_is_downloaded(tmp_path):
    """The README's CPU lines against a checkout whose requires-python this Python misses (as 3.10
    misses >=3.11): the first `pip install` stops, and torch is never fetched."""
    checkout = fresh_checkout(tmp_path / "checkout")
    pyproject = checkout / "pyproject.toml"
    pyproject.write_text(pyproject.read_text().replace('requires-python = ">=3.11"', 'requires-python = ">=3.99"'))
    shell = Shell(checkout, user_environ())
    for line in readme_block("**CPU only**"):
        result = shell.run(line)
        if result.returncode != 0:
            break
    assert line == ".venv/bin/pip install -e .", line
    assert "requires a different Python" in result.stdout + result.stderr
    assert not list(checkout.glob(".venv/lib/python*/site-packages/torch"))


def test_the_gpu_block_is_the_cpu_block_with_pypi_s_torch_and_the_flash4_extra():
    """It cannot run here (no GPU): its lines are checked against the CPU block's, which runs."""
    cpu, gpu = readme_block("**CPU only**"), readme_block("**NVIDIA GPU (CUDA)**")
    assert gpu[:2] == cpu[:2] and gpu[2] == cpu[2].split(" --index-url")[0]
    assert gpu[3] == ".venv/bin/pip install -e '.[flash4]'" and gpu[4] == ".venv/bin/sparkwire up"
