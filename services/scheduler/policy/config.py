"""The policy's limits and the model facts it schedules by, validated once."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.flags import VERIFY_MODES
from services.scheduler.spec.step_cost import DEFAULT_POINTS


@dataclass(frozen=True)
class PolicyConfig:
    num_blocks: int
    block_size: int
    max_running_requests: int
    chunk_budget: int  # tokens per step
    max_model_len: int
    vocab_size: int
    eos_ids: frozenset[int]
    prefill_budget: int | None = None  # tokens per step while nothing decodes; None: chunk_budget
    num_draft_tokens: int = 0
    verify_mode: str = "static"
    verify_step_cost: tuple[tuple[int, float], ...] = DEFAULT_POINTS  # `compact`: (tokens, seconds) of a step
    seed: int = 0  # seeds the sampling seeds of requests that bring none
    prefix_caching: bool = True  # full KV blocks kept and shared across requests (`prefix_cache.py`)
    cache_prompt_rows: bool = True  # with it, prompt logprob rows kept with the blocks (raw rows only: `prompt_rows.py`)

    def __post_init__(self) -> None:
        for name in ("max_running_requests", "chunk_budget", "max_model_len", "vocab_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be positive; got {getattr(self, name)}")
        if self.verify_mode not in VERIFY_MODES:
            raise ValueError(f"verify_mode must be one of {', '.join(VERIFY_MODES)}; got {self.verify_mode!r}")
