"""Build the random tiny test model (`services.models.RANDOM_TINY_MODEL`; the bundled default is the
trained pair, see ops/train/): its byte-level BPE tokenizer (trained deterministically from local
text) and its config files; weights are seeded-random, so none are written.

The corpus is the top-level CPython stdlib sources of the running interpreter (a fixed, sorted
file list), so anyone can rebuild the exact tokenizer without a download. The tokenizer is the
bundled one's byte-level BPE (`ops.train.tokenizer.train_byte_level_bpe`, with its ChatML
`tokenizer_config.json`), minus the mask token and the newline split.

    python ops/models/build_tiny_tokenizer.py [--out ops/models/sparkwire-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository root, not this folder, holds `ops`
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tokenizers import Tokenizer

from ops.train.tokenizer import (
    END_OF_TEXT,
    IM_END,
    IM_START,
    MODEL_MAX_LENGTH,
    save_tokenizer,
    tokenizer_config,
    train_byte_level_bpe,
)

SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END)
VOCAB_SIZE = 2048  # specials included; a multiple of 64 so the embedding table shards evenly
DEFAULT_OUT = Path(__file__).resolve().parent / "sparkwire-tiny"


def corpus_files() -> list[Path]:
    stdlib = Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}"
    files = sorted(stdlib.glob("*.py"))
    if not files:
        raise FileNotFoundError(f"no stdlib sources under {stdlib}")
    return files


def iter_corpus(files: list[Path]) -> Iterator[str]:
    for path in files:
        yield path.read_text(encoding="utf-8", errors="replace")


def train_tokenizer(files: list[Path]) -> Tokenizer:
    return train_byte_level_bpe(iter_corpus(files), VOCAB_SIZE, SPECIAL_TOKENS, split_newlines=False)


def model_config(eos_ids: list[int]) -> dict:
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 128,
        "intermediate_size": 384,
        "num_hidden_layers": 4,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "bos_token_id": eos_ids[1],
        "eos_token_id": eos_ids,
        "sparkwire_weights": "seeded-random",
        "sparkwire_seed": 0,
    }


def generation_config(eos_ids: list[int]) -> dict:
    return {"bos_token_id": eos_ids[1], "eos_token_id": eos_ids, "do_sample": False}


def write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer(corpus_files())
    save_tokenizer(tokenizer, args.out, tokenizer_config(mask_token=None))
    eos_ids = [tokenizer.token_to_id(IM_END), tokenizer.token_to_id(END_OF_TEXT)]
    write_json(args.out / "config.json", model_config(eos_ids))
    write_json(args.out / "generation_config.json", generation_config(eos_ids))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    print(f"wrote {args.out}: vocab {VOCAB_SIZE}, special ids {ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
