"""Build the random tiny test model (`services.models.RANDOM_TINY_MODEL`; the bundled default is the
trained pair, see ops/train/): its byte-level BPE tokenizer (trained deterministically from local
text) and its config files; weights are seeded-random, so none are written.

The corpus is the top-level CPython stdlib sources of the running interpreter (a fixed, sorted
file list), so anyone can rebuild the exact tokenizer without a download. Byte-level
pre-tokenization and decoding make every byte string encodable and every decode exact.

    python ops/models/build_tiny_tokenizer.py [--out ops/models/sparkwire-tiny]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
VOCAB_SIZE = 2048  # specials included; a multiple of 64 so the embedding table shards evenly
MODEL_MAX_LENGTH = 32768
DEFAULT_OUT = Path(__file__).resolve().parent / "sparkwire-tiny"

# Qwen's ChatML template, minus tools: the tiny model is only for plumbing tests.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


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
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(iter_corpus(files), trainer=trainer)
    return tokenizer


def tokenizer_config() -> dict:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }


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
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(corpus_files())
    if tokenizer.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, wanted {VOCAB_SIZE}")
    tokenizer.save(str(args.out / "tokenizer.json"), pretty=False)
    eos_ids = [tokenizer.token_to_id("<|im_end|>"), tokenizer.token_to_id("<|endoftext|>")]
    write_json(args.out / "tokenizer_config.json", tokenizer_config())
    write_json(args.out / "config.json", model_config(eos_ids))
    write_json(args.out / "generation_config.json", generation_config(eos_ids))
    ids = {tok: tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS}
    print(f"wrote {args.out}: vocab {VOCAB_SIZE}, special ids {ids}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
