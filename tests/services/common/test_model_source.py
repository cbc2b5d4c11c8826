"""`--model ORG/NAME`: a Hugging Face model id resolved from a local hub cache built here (offline),
by every service's own config; a wrong id and `--trust-remote-code` are one line each."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.model_source import ModelSourceError, is_model_id, resolve_model, served_name
from services.models import RANDOM_TINY_MODEL

REPO = Path(__file__).resolve().parents[3]
MAIN, OTHER = "a" * 40, "b" * 40  # two commits of the cached repo; refs/main points at MAIN


@pytest.fixture
def hub_home(tmp_path: Path) -> Path:
    """HF_HOME holding org/tiny (the bundled random model's files) as huggingface_hub caches a repo:
    hub/models--org--tiny/{refs/main, snapshots/<commit>/...}."""
    repo = tmp_path / "hf" / "hub" / "models--org--tiny"
    for commit in (MAIN, OTHER):
        shutil.copytree(RANDOM_TINY_MODEL, repo / "snapshots" / commit)
    (repo / "snapshots" / OTHER / "marker.json").write_text("{}")
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(MAIN)
    return tmp_path / "hf"


def run_python(code: str, hub_home: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """huggingface_hub reads HF_HOME and HF_HUB_OFFLINE when imported: a child process with them set."""
    env = {**os.environ, "HF_HOME": str(hub_home), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    env.pop("HF_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=120)


SERVICE_CONFIGS = """
import argparse, json, sys
from services.scheduler.__main__ import add_arguments as scheduler_args, config_from_args as scheduler_config
from services.tokenizer.__main__ import add_arguments as tokenizer_args, build_config as tokenizer_config
from services.detokenizer.__main__ import add_arguments as detokenizer_args, config_from_args as detokenizer_config

def parse(add, argv):
    parser = argparse.ArgumentParser()
    add(parser)
    return parser.parse_args(argv)

argv = sys.argv[1:]
scheduler = scheduler_config(parse(scheduler_args, argv))
tokenizer = tokenizer_config(parse(tokenizer_args, argv))
detokenizer = detokenizer_config(parse(detokenizer_args, argv))
print(json.dumps({"scheduler": scheduler.model, "tokenizer": str(tokenizer.model_dir), "name": tokenizer.model_name,
                  "detokenizer": str(detokenizer.tokenizer_path)}))
"""


def test_every_service_resolves_a_model_id_from_the_cache_offline(hub_home: Path) -> None:
    done = run_python(SERVICE_CONFIGS, hub_home, "--model", "org/tiny")
    assert done.returncode == 0, done.stderr[-3000:]
    snapshot = hub_home / "hub" / "models--org--tiny" / "snapshots" / MAIN
    configs = json.loads(done.stdout.strip().splitlines()[-1])
    assert configs == {"scheduler": str(snapshot), "tokenizer": str(snapshot), "name": "org/tiny",
                       "detokenizer": str(snapshot / "tokenizer.json")}  # fmt: skip


def test_a_revision_picks_its_snapshot(hub_home: Path) -> None:
    code = "import sys; from services.common.model_source import resolve_model; print(resolve_model(*sys.argv[1:]))"
    done = run_python(code, hub_home, "org/tiny", OTHER)
    assert done.returncode == 0, done.stderr[-3000:]
    assert Path(done.stdout.strip()) == hub_home / "hub" / "models--org--tiny" / "snapshots" / OTHER


@pytest.mark.parametrize("service", ["scheduler", "tokenizer", "detokenizer"])
def test_a_wrong_id_is_one_line(hub_home: Path, service: str) -> None:
    code = "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))"
    done = run_python(code, hub_home, service, "--model", "org/missing", "--nats-url", "nats://127.0.0.1:1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot load model id 'org/missing'" in lines[0], done.stderr[-2000:]


def test_trust_remote_code_is_refused_in_one_line(hub_home: Path) -> None:
    code = "import sys; from services.cli import main; sys.exit(main(sys.argv[1:]))"
    done = run_python(code, hub_home, "scheduler", "--model", "org/tiny", "--trust-remote-code", "--nats-url", "nats://127.0.0.1:1")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "--trust-remote-code is not supported" in lines[0]


def test_local_paths_stay_as_they_are() -> None:
    assert resolve_model(str(RANDOM_TINY_MODEL)) == RANDOM_TINY_MODEL
    assert served_name(str(RANDOM_TINY_MODEL)) == "" and served_name("org/tiny") == "org/tiny"
    with pytest.raises(ModelSourceError, match="applies to a model id"):
        resolve_model(str(RANDOM_TINY_MODEL), revision="main")
    with pytest.raises(ModelSourceError, match="not a Hugging Face model id"):
        resolve_model("/no/such/dir")  # never asks the hub


def test_model_id_shape() -> None:
    assert is_model_id("Qwen/Qwen3-8B") and is_model_id("gpt2")
    assert not any(map(is_model_id, ["/abs/dir", "./rel", "a/b/c", "org/", "~/models"]))
