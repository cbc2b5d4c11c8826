"""Triton kernels' CPU checks: a file's `interpreted` cases run in a child pytest whose Triton
starts in interpreter mode (Triton reads TRITON_INTERPRET when it is imported). The test extras
install Triton (pyproject.toml), so CI runs them; without it both the runner test and the cases skip."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[4]
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# The test that starts the child: only outside the interpreter, where Triton is installed.
runs_the_interpreter = pytest.mark.skipif(
    INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton; runs the interpreter"
)
# A case for the child only (its name must contain "interpreted").
interpreted = pytest.mark.skipif(not INTERPRETED, reason="run in the Triton interpreter by its file's runner test")


def interpreter_environ() -> dict[str, str]:
    """Ours, with Triton in interpreter mode and the repository importable (a child runs a script).
    The interpreter's tl.dot is numpy's matmul: OpenBLAS's AVX2/AVX-512 sgemm kernels round a row
    differently by its place in the block (seen on an AMD EPYC), which a GPU's tensor cores do not,
    so the batch-invariance cases take its SSE/AVX kernel, whose rows are their own."""
    return {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(REPO), "OPENBLAS_CORETYPE": "Sandybridge"}


def run_script_interpreted(script: str, args: list[str], timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the repository's `script` (a GPU check's CPU smoke mode) with Triton interpreted; it must exit 0."""
    command = [sys.executable, str(REPO / script), *args]
    done = subprocess.run(command, cwd=REPO, env=interpreter_environ(), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return done


# pytest plugins the interpreted cases never use, left unloaded in the child: they took ~1.8 of its
# ~5.4 s start-up (2-core CPU box). A name that is not installed is ignored.
UNUSED_PLUGINS = ("hypothesispytest", "schemathesis", "faker")


def run_interpreted_cases(test_file: str, timeout_s: float = 300) -> None:
    """Run `test_file`'s cases named *interpreted* in a child pytest under TRITON_INTERPRET=1; every
    one must pass, none skip."""
    unloaded = [arg for name in UNUSED_PLUGINS for arg in ("-p", f"no:{name}")]
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *unloaded, "-k", "interpreted", test_file]
    done = subprocess.run(command, cwd=REPO, env=interpreter_environ(), capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0 and " passed" in done.stdout and "skipped" not in done.stdout, (
        done.stdout[-4000:] + done.stderr[-2000:]
    )


# Triton's compiler (not the interpreter, no GPU needed): what only it refuses fails on the CPU too.
compiles = pytest.mark.skipif(INTERPRETED or importlib.util.find_spec("triton") is None, reason="needs Triton (its compiler, not a GPU)")


def compile_for_hopper(kernel, signature: dict[str, str], constants: dict, divisible: tuple[str, ...] = (), **options) -> bytes:
    """`kernel` compiled down to an sm_90 cubin (H100/H200) with these argument types and constexprs;
    `divisible`: arguments known to be multiples of 16, as Triton's launcher specializes them at run
    time (a K of 4096, a row stride): what lets masked loads vectorize and the K loop pipeline."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in divisible}
    source = ASTSource(kernel, {**signature, **dict.fromkeys(constants, "constexpr")}, constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
