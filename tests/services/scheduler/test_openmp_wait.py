"""A scheduler process gives OpenMP the passive wait policy before torch loads libgomp, unless the
environment names one (services/scheduler/__init__.py)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
# What the scheduler's entry point imports first, then the policy libgomp will have read.
PROBE = "import services.scheduler.__main__, os, torch; print(os.environ['OMP_WAIT_POLICY'])"


def policy_seen(environ: dict[str, str]) -> str:
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=environ, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_passive_unless_named() -> None:
    environ = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    assert policy_seen(environ) == "PASSIVE"


@pytest.mark.parametrize("named", ["ACTIVE", "passive"])
def test_a_named_policy_is_kept(named: str) -> None:
    assert policy_seen({**os.environ, "OMP_WAIT_POLICY": named}) == named
