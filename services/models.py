"""Where the models that ship with Sparkwire live: the one definition every service and the CLI use.

- `BUNDLED_MODEL` / `BUNDLED_DRAFT_MODEL`: the default pair of `sparkwire up` (and of
  `--speculative-algorithm dspark`), a micro Qwen3 target and its DSpark drafter trained by the
  project on Python source (ops/train/, model card in ops/models/sparkwire-micro/README.md).
- `RANDOM_TINY_MODEL`: seeded random weights (config and tokenizer only), for plumbing tests that
  want a model whose output means nothing and costs nothing.
"""

from __future__ import annotations

from pathlib import Path

MODELS_DIR = Path(__file__).resolve().parents[1] / "ops" / "models"
BUNDLED_MODEL = MODELS_DIR / "sparkwire-micro"
BUNDLED_DRAFT_MODEL = MODELS_DIR / "sparkwire-micro-dspark"
RANDOM_TINY_MODEL = MODELS_DIR / "sparkwire-tiny"
