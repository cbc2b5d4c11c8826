"""The bundled tokenizer: byte-level BPE trained on the corpus's train split.

    python -m ops.train.tokenizer --corpus /tmp/corpus --out ops/models/sparkwire-micro

Writes `tokenizer.json` and `tokenizer_config.json` (with a ChatML chat template) into `--out`.
Byte-level pre-tokenization and decoding make every byte string encodable and every decode exact.
Each newline is its own pre-token, so no token spans a line break: indentation is a token of its
own after "\n", and a prompt that ends with "\n" (a common way to type `def f(n):\n`) sits on a
token boundary the model saw in training, instead of a lone "\n" it never saw before spaces.
Ids 0..3 are the special tokens, in SPECIAL_TOKENS order, so every recipe agrees on them.

The BPE setup itself (`train_byte_level_bpe`), the ChatML template and `tokenizer_config.json` are
also what `ops/models/build_tiny_tokenizer.py` builds the random test model's tokenizer with: it
imports them from here (this module imports nothing of ops/models, so there is no cycle).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from ops.train.corpus import read_split

END_OF_TEXT = "<|endoftext|>"  # separates documents in training; the pad token
IM_START, IM_END = "<|im_start|>", "<|im_end|>"  # ChatML role delimiters; IM_END ends a turn (eos)
MASK = "<|mask|>"  # the DSpark drafter's mask input (never produced by the tokenizer from text)
SPECIAL_TOKENS = (END_OF_TEXT, IM_START, IM_END, MASK)
VOCAB_SIZE = 4096  # specials included; a multiple of 64 so the embedding table shards evenly
# Positions are RoPE only (nothing learnt per position), so the context the server accepts is a
# serving limit: long prompts (the product's 32k prompt-logprob case) run; text quality past the
# 512-token training windows is not promised.
MODEL_MAX_LENGTH = 32768

# ChatML, as Qwen 2.5 writes it, tools included (Hermes `<tool_call>` JSON: the tokenizer's tool
# parser reads it back). The tokenizer service renders it with trim_blocks and lstrip_blocks, so
# every newline inside the output is an explicit '\n'.
CHAT_TEMPLATE =(
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages and messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if tools and loop.first and message['role'] == 'system' %}"
    "{%- elif message['role'] == 'assistant' and message['tool_calls'] %}"
    "{{- '<|im_start|>assistant' }}{%- if message['content'] %}{{- '\\n' + message['content'] }}{%- endif %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '\\n<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' }}"
    "{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + message['content'] + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- else %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    """The bundled tokenizer: SPECIAL_TOKENS first, a newline never inside a token."""
    return train_byte_level_bpe(texts, vocab_size, SPECIAL_TOKENS, split_newlines=True)


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, special_tokens: Sequence[str], split_newlines: bool
) -> Tokenizer:
    """Byte-level BPE of exactly `vocab_size` tokens, `special_tokens` taking ids 0.., deterministic
    for the same texts. `split_newlines`: each "\n" is a pre-token of its own (module docstring)."""
    tokenizer = Tokenizer(models.BPE())
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if split_newlines:
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), behavior="isolated"), byte_level])
    else:
        tokenizer.pre_tokenizer = byte_level
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained vocab has {tokenizer.get_vocab_size()} tokens, wanted {vocab_size}")
    return tokenizer


def special_ids(tokenizer: Tokenizer) -> dict[str, int]:
    return {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}


def tokenizer_config(mask_token: str | None = MASK) -> dict:
    """tokenizer_config.json; `mask_token=None` leaves the key out (a tokenizer without MASK)."""
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": IM_END,
        "pad_token": END_OF_TEXT,
        "unk_token": None,
        "mask_token": mask_token,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "chat_template": CHAT_TEMPLATE,
    }
    if mask_token is None:
        del config["mask_token"]
    return config


def save_tokenizer(tokenizer: Tokenizer, out: Path, config: dict | None = None) -> None:
    """tokenizer.json and tokenizer_config.json (`config`, by default `tokenizer_config()`) in `out`."""
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=False)
    text = json.dumps(tokenizer_config() if config is None else config, indent=2) + "\n"
    (out / "tokenizer_config.json").write_text(text, encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", type=Path, required=True, help="a directory built by ops.train.corpus")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    args = parser.parse_args(argv)
    tokenizer = train_tokenizer([text for _, text in read_split(args.corpus, "train")], args.vocab_size)
    save_tokenizer(tokenizer, args.out)
    print(f"wrote {args.out}/tokenizer.json: vocab {tokenizer.get_vocab_size()}, special ids {special_ids(tokenizer)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
