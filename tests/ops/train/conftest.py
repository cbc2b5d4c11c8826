"""A small fake standard library, its corpus and a tokenizer trained on it (fast enough for CI)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.train.corpus import build_manifest, collect, split_of, write_corpus
from ops.train.tokenizer import save_tokenizer, train_tokenizer

REPO = Path(__file__).resolve().parents[3]
NUM_FILES = 50  # m000.py .. m049.py: m020, m039 and m046 fall in the held-out split
TOY_VOCAB = 400


def write_fake_stdlib(root: Path) -> Path:
    """NUM_FILES distinct modules (copies of this repo's sources, each with its own first line)."""
    sources = [path for path in sorted((REPO / "services").rglob("*.py")) if path.stat().st_size > 500]
    root.mkdir(parents=True, exist_ok=True)
    for index in range(NUM_FILES):
        (root / f"m{index:03d}.py").write_text(f"# copy {index}\n" + sources[index % len(sources)].read_text())
    return root


@pytest.fixture(scope="session")
def fake_stdlib(tmp_path_factory) -> Path:
    root = write_fake_stdlib(tmp_path_factory.mktemp("stdlib") / "python3.12")
    assert any(split_of(path.name) == "eval" for path in root.glob("*.py"))
    return root


@pytest.fixture(scope="session")
def toy_corpus(fake_stdlib, tmp_path_factory) -> Path:
    files = collect(fake_stdlib)
    out = tmp_path_factory.mktemp("corpus")
    write_corpus(files, build_manifest(files, "3.12.test"), out)
    return out


@pytest.fixture(scope="session")
def toy_tokenizer_dir(toy_corpus, tmp_path_factory) -> Path:
    from ops.train.corpus import read_split

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer([text for _, text in read_split(toy_corpus, "train")], TOY_VOCAB), out)
    return out
