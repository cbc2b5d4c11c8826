"""The bundled tiny model's tokenizer: exact byte-level round trips, special ids, both loaders."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer

from services.models import RANDOM_TINY_MODEL

TEXTS = [
    "Hello, world!",
    "héllo wörld — ünïcödé ✓ 中文字符 日本語 한국어 العربية",
    "emoji 😀🧪👩‍👩‍👧 and a flag 🇫🇷",
    "\x00\x01\t\r\n   trailing spaces   \n\n",
    "def f(x):\n    return x ** 2  # comment\n",
    "zero\u200bwidth \ufeff bom \U0010ffff",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(RANDOM_TINY_MODEL / "tokenizer.json"))


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tokenizer: Tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    assert ids and tokenizer.decode(ids, skip_special_tokens=False) == text


def test_vocab_and_special_ids_match_config(tokenizer: Tokenizer) -> None:
    config = json.loads((RANDOM_TINY_MODEL / "config.json").read_text())
    assert tokenizer.get_vocab_size() == config["vocab_size"] and config["vocab_size"] % 64 == 0
    im_end, eot = tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")
    assert config["eos_token_id"] == [im_end, eot]
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False).ids[0] == tokenizer.token_to_id("<|im_start|>")


def test_committed_files_are_small() -> None:
    assert sum(p.stat().st_size for p in RANDOM_TINY_MODEL.iterdir()) < 1_000_000
    assert not list(RANDOM_TINY_MODEL.glob("*.safetensors"))


def test_transformers_loads_tokenizer_and_chat_template() -> None:
    from transformers import AutoTokenizer

    auto = AutoTokenizer.from_pretrained(RANDOM_TINY_MODEL)
    assert auto.eos_token == "<|im_end|>" and len(auto) == 2048
    text = auto.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert auto.decode(auto.encode(TEXTS[1], add_special_tokens=False)) == TEXTS[1]
