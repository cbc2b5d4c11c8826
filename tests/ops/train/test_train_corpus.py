"""The corpus rules (selection, dedupe, held-out split, manifest check) and the tokenizer."""

from __future__ import annotations

import json
import shutil

import pytest
from tokenizers import Tokenizer

from ops.train.corpus import (
    COMMITTED_MANIFEST,
    CorpusMismatchError,
    build_manifest,
    check_manifest,
    collect,
    listing_sha256,
    read_split,
)
from ops.train.tokenizer import (
    SPECIAL_TOKENS,
    save_tokenizer,
    special_ids,
    tokenizer_config,
    train_byte_level_bpe,
    train_tokenizer,
)
from services.models import BUNDLED_MODEL
from services.tokenizer.text_model import TextModel


def test_selection_dedupes_and_drops_generated_binary_and_site_packages(fake_stdlib, tmp_path):
    root = tmp_path / "lib"
    shutil.copytree(fake_stdlib, root)
    (root / "zz_copy_of_m001.py").write_text((root / "m001.py").read_text())  # exact duplicate
    (root / "cp999.py").write_text('""" Python Character Mapping Codec cp999 generated from X with gencodec.py.\n' + "x = 1\n" * 20)
    (root / "latin1.py").write_bytes(b"# \xff\xfe not utf-8\n" * 10)
    (root / "site-packages").mkdir()
    (root / "site-packages" / "pkg.py").write_text("import os\n" * 20)
    kept = [f.path for f in collect(root)]
    assert kept == [f"m{i:03d}.py" for i in range(50)]  # sorted, first path of a duplicate wins


def test_split_is_stable_and_the_manifest_check_names_what_changed(fake_stdlib, tmp_path):
    files = collect(fake_stdlib)
    manifest = build_manifest(files, "3.12.test")
    assert manifest["num_files"] == {"train": 47, "eval": 3}
    check_manifest(build_manifest(collect(fake_stdlib), "3.12.test"), manifest)  # a rebuild is equal
    root = tmp_path / "lib"
    shutil.copytree(fake_stdlib, root)
    (root / "m007.py").write_text("changed = True\n" * 10)
    with pytest.raises(CorpusMismatchError, match=r"1 changed \['m007.py'\]"):
        check_manifest(build_manifest(collect(root), "3.12.test"), manifest)


def test_written_corpus_round_trips(toy_corpus, fake_stdlib):
    held_out = read_split(toy_corpus, "eval")
    assert [path for path, _ in held_out] == ["m020.py", "m039.py", "m046.py"]
    assert held_out[0][1] == (fake_stdlib / "m020.py").read_text()


def test_committed_manifest_is_self_consistent_and_pinned():
    manifest = json.loads(COMMITTED_MANIFEST.read_text())
    assert manifest["python_version"].startswith("3.12.")
    assert listing_sha256(manifest["files"]) == manifest["corpus_sha256"]
    assert manifest["packages"] and all(version for version in manifest["packages"].values())
    splits = [entry[3] for entry in manifest["files"]]
    assert splits.count("eval") == manifest["num_files"]["eval"] > 0


def test_tokenizer_specials_round_trip_and_newlines_stand_alone():
    texts = ["def f(n):\n    if n < 2:\n        return n\n    return f(n - 1)\n"] * 20
    tokenizer = train_tokenizer(texts, vocab_size=270)  # 256 bytes + 4 specials + 10 merges
    assert list(special_ids(tokenizer).values()) == [0, 1, 2, 3]
    encoding = tokenizer.encode(texts[0] + "é€😀")
    assert tokenizer.decode(encoding.ids) == texts[0] + "é€😀"
    assert all(token == "Ċ" or "Ċ" not in token for token in encoding.tokens)


def test_the_shared_bpe_builder_splits_newlines_only_when_asked(tmp_path):
    texts = ["def f(n):\n    if n < 2:\n        return n\n    return f(n - 1)\n"] * 20
    specials = SPECIAL_TOKENS[:3]  # build_tiny_tokenizer's set: no mask
    joined = train_byte_level_bpe(texts, 266, specials, split_newlines=False)  # 7 merges
    split = train_byte_level_bpe(texts, 266, specials, split_newlines=True)
    assert [joined.id_to_token(i) for i in range(3)] == list(specials)
    assert any("Ċ" in token and token != "Ċ" for token in joined.get_vocab())  # a merge across "\n"
    assert all("Ċ" not in token or token == "Ċ" for token in split.get_vocab())
    with pytest.raises(RuntimeError, match="wanted 999"):
        train_byte_level_bpe(texts, 999, specials, split_newlines=False)  # too little text for that many merges
    save_tokenizer(joined, tmp_path, tokenizer_config(mask_token=None))
    written = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert list(written) == [key for key in tokenizer_config() if key != "mask_token"]
    assert Tokenizer.from_file(str(tmp_path / "tokenizer.json")).get_vocab_size() == 266


def test_bundled_tokenizer_has_the_specials_and_a_chat_template():
    tokenizer = Tokenizer.from_file(str(BUNDLED_MODEL / "tokenizer.json"))
    assert [tokenizer.id_to_token(i) for i in range(len(SPECIAL_TOKENS))] == list(SPECIAL_TOKENS)
    text_model = TextModel.from_dir(BUNDLED_MODEL)
    rendered = text_model.render_chat([{"role": "user", "content": "hi"}])
    assert rendered == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
