"""What `sparkwire bench serve` sends, and when.

Prompts are random token ids of chosen lengths (exact input lengths without a client-side
tokenizer: both /generate `input_ids` and /v1/completions token-id prompts take them as they are)
or the lines of a JSONL file. Arrival offsets follow a gamma process: shape = burstiness (1 is
Poisson; below 1 burstier, above 1 more regular), mean interval 1 / rate; an infinite rate sends
everything at once (a burst).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


@dataclass(frozen=True)
class Prompt:
    """One request's input: exactly one of `input_ids` and `text`."""

    input_ids: tuple[int, ...] | None
    text: str | None
    output_len: int

    def __post_init__(self) -> None:
        if (self.input_ids is None) == (self.text is None):
            raise ValueError("a prompt has input_ids or text, not both or neither")
        if self.output_len < 1:
            raise ValueError(f"output_len must be >= 1, got {self.output_len}")


def token_pool(model_dir: Path) -> np.ndarray:
    """Ids a random prompt may use: the tokenizer's own vocabulary without its special tokens
    (a stray end-of-text or chat marker would change what the prompt means to the server)."""
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    ids = np.arange(tokenizer.get_vocab_size(with_added_tokens=False), dtype=np.int64)
    return ids[~np.isin(ids, list(special))]  # [V - specials]


def lengths(num: int, mean: int, range_ratio: float, rng: np.random.Generator) -> np.ndarray:
    """Uniform in [mean * (1 - r), mean * (1 + r)], at least 1; r = 0 gives exactly `mean`."""
    low, high = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
    return rng.integers(low, high + 1, size=num)  # [num]


def random_prompts(
    num: int, input_len: int, output_len: int, range_ratio: float, pool: np.ndarray, seed: int
) -> list[Prompt]:
    rng = np.random.default_rng(seed)
    inputs, outputs = lengths(num, input_len, range_ratio, rng), lengths(num, output_len, range_ratio, rng)
    return [
        Prompt(tuple(int(i) for i in rng.choice(pool, size=n_in)), None, int(n_out))
        for n_in, n_out in zip(inputs, outputs, strict=True)
    ]


def jsonl_prompts(path: Path, num: int, output_len: int) -> list[Prompt]:
    """The first `num` lines; each is `{"prompt": str}` or `{"input_ids": [int]}`, with an
    optional `"output_len"` (else `output_len`)."""
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if len(prompts) == num:
            break
        if line.strip():
            prompts.append(_jsonl_prompt(json.loads(line), output_len, f"{path}:{number}"))
    if not prompts:
        raise ValueError(f"{path} has no prompts")
    return prompts


def _jsonl_prompt(row: dict, output_len: int, where: str) -> Prompt:
    ids, text = row.get("input_ids"), row.get("prompt")
    try:
        return Prompt(tuple(int(i) for i in ids) if ids is not None else None, text, int(row.get("output_len", output_len)))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{where}: {exc}") from None


def arrival_offsets(num: int, request_rate: float, burstiness: float, seed: int) -> np.ndarray:
    """Seconds from the start at which each request is due; the first at 0."""
    if math.isinf(request_rate):
        return np.zeros(num)
    rng = np.random.default_rng(seed + 1)  # not the prompts' stream: changing lengths keeps the timing
    intervals = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=max(num - 1, 0))
    return np.concatenate([[0.0], np.cumsum(intervals)])  # [num]


def shared_prefix_prompts(
    num_groups: int, prompts_per_group: int, system_len: int, question_len: int, output_len: int, pool: np.ndarray, seed: int
) -> list[Prompt]:
    """SGLang's `generated-shared-prefix` shape: `num_groups` system prompts of `system_len` ids,
    each followed by `prompts_per_group` questions of `question_len` ids; the requests in a random
    order (a group's requests arrive spread over the run, as a service's users' do)."""
    rng = np.random.default_rng(seed)
    systems = [tuple(int(i) for i in rng.choice(pool, size=system_len)) for _ in range(num_groups)]
    prompts = [Prompt(system + tuple(int(i) for i in rng.choice(pool, size=question_len)), None, output_len)
               for system in systems for _ in range(prompts_per_group)]  # fmt: skip
    order = rng.permutation(len(prompts))
    return [prompts[i] for i in order]


def multi_turn_prompts(
    num_conversations: int, num_turns: int, turn_len: int, output_len: int, pool: np.ndarray, seed: int
) -> list[list[Prompt]]:
    """Conversations that grow turn by turn: turn t's prompt is turn t - 1's, an answer of
    `output_len` ids standing in for the reply (ids, not the reply's text: a fixed workload), and a
    new message of `turn_len` ids. [turn][conversation]: send a turn once the one before is answered."""
    rng = np.random.default_rng(seed)
    histories: list[tuple[int, ...]] = [() for _ in range(num_conversations)]
    turns = []
    for _ in range(num_turns):
        histories = [h + tuple(int(i) for i in rng.choice(pool, size=turn_len)) for h in histories]
        turns.append([Prompt(h, None, output_len) for h in histories])
        histories = [h + tuple(int(i) for i in rng.choice(pool, size=output_len)) for h in histories]
    return turns
