"""`--tokenizer` and `--chat-template`: the tokenizer's files and its chat template from elsewhere
than `--model`, through the tokenizer service's own config."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from services.models import RANDOM_TINY_MODEL
from services.tokenizer.__main__ import add_arguments, build_config
from services.tokenizer.text_model import TextModel

MESSAGES = [{"role": "user", "content": "hi"}]


def config_for(*argv: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return build_config(parser.parse_args(["--nats-url", "nats://127.0.0.1:1", *argv]))


@pytest.fixture
def model_without_tokenizer(tmp_path: Path) -> Path:
    """A model directory holding only config.json (the tokenizer lives elsewhere), with its own max length."""
    model = tmp_path / "model"
    model.mkdir()
    config = json.loads((RANDOM_TINY_MODEL / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 777}))
    return model


def test_tokenizer_files_from_another_directory(model_without_tokenizer: Path) -> None:
    with pytest.raises(ValueError, match="no tokenizer.json"):
        config_for("--model", str(model_without_tokenizer))
    config = config_for("--model", str(model_without_tokenizer), "--tokenizer", str(RANDOM_TINY_MODEL))
    assert config.text_dir == RANDOM_TINY_MODEL and config.model_name == "model"
    text = TextModel.from_dir(config.model_dir, config.max_model_len, config.tokenizer_dir, config.chat_template)
    assert text.max_model_len == 777  # config.json still from --model
    assert text.render_chat(MESSAGES, add_generation_prompt=True).startswith("<|im_start|>user\nhi")


def test_a_chat_template_file_wins_over_the_tokenizers(tmp_path: Path) -> None:
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}{% endfor %}")
    config = config_for("--model", str(RANDOM_TINY_MODEL), "--chat-template", str(template))
    text = TextModel.from_dir(config.model_dir, config.max_model_len, config.tokenizer_dir, config.chat_template)
    assert text.render_chat(MESSAGES) == "[user] hi"
    plain = TextModel.from_dir(RANDOM_TINY_MODEL)
    assert plain.render_chat(MESSAGES) != "[user] hi"


def test_a_missing_template_file_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--chat-template .*no such file"):
        config_for("--model", str(RANDOM_TINY_MODEL), "--chat-template", str(tmp_path / "none.jinja"))


def test_trust_remote_code_is_refused() -> None:
    with pytest.raises(ValueError, match="--trust-remote-code is not supported"):
        config_for("--model", str(RANDOM_TINY_MODEL), "--trust-remote-code")


def test_a_copied_model_directory_keeps_its_name(tmp_path: Path) -> None:
    copy = shutil.copytree(RANDOM_TINY_MODEL, tmp_path / "my-model")
    assert config_for("--model", str(copy)).model_name == "my-model"
