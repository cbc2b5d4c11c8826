"""Fixtures and builders for detokenizer tests."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from contracts.detokenizer import Finish, TokenBatch
from services.common.arrays import to_wire
from services.common.logprob_rows import RequestLogprobs, RowLogprobs
from tests.logprob_entries import batch_columns
from services.models import RANDOM_TINY_MODEL

TOKENIZER_PATH = RANDOM_TINY_MODEL / "tokenizer.json"


@pytest.fixture(scope="session")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(TOKENIZER_PATH))


@pytest.fixture(scope="session")
def tokenizer_path() -> Path:
    return TOKENIZER_PATH


def token_batch(
    entries: Sequence[tuple[str, Sequence[int], Finish | None]],
    logprobs: Sequence[RequestLogprobs | None] | None = None,
    step: int = 0,
    scheduler_id: str = "sched-1",
    spec_verify_ct: Sequence[int] | None = None,
) -> TokenBatch:
    """A TokenBatch over (rid, new ids, finish) entries; prompt_tokens[i] = 10 + i."""
    counts = np.array([len(ids) for _, ids, _ in entries], dtype=np.int32)
    flat = np.concatenate([np.asarray(ids, dtype=np.int32) for _, ids, _ in entries] or [np.zeros(0, np.int32)])
    return TokenBatch(
        scheduler_id=scheduler_id,
        step=step,
        rids=[rid for rid, _, _ in entries],
        num_new_tokens=to_wire(counts),
        new_token_ids=to_wire(flat.astype(np.int32)),
        prompt_tokens=to_wire(np.arange(10, 10 + len(entries), dtype=np.int32)),
        finish=[finish for _, _, finish in entries],
        spec_verify_ct=None if spec_verify_ct is None else to_wire(np.asarray(spec_verify_ct, dtype=np.int32)),
        **batch_columns(logprobs),
    )


def output_logprobs(n: int, k: int, m: int, seed: int = 0) -> RequestLogprobs:
    """Random output logprob arrays for n positions: [n], [n, k], [n, k], [n, m]."""
    rng = np.random.default_rng(seed)
    return RequestLogprobs(output=RowLogprobs.of(-rng.random(n, dtype=np.float32), -rng.random((n, k), dtype=np.float32),
                                                 rng.integers(0, 2048, (n, k), dtype=np.int32), -rng.random((n, m), dtype=np.float32)))
