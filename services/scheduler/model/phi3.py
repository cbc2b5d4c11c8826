"""Phi-3: the shared decoder (`llama.py`) as it is; only the checkpoint differs.

Phi-3 checkpoints ship q/k/v as one `qkv_proj` ([q | k | v] rows) and gate/up as one `gate_up_proj`
([gate | up] rows): the runtime's own fused layout, so each tensor fills its parameter whole.
Sliding windows (`sliding_window`, every layer) and LongRoPE (`rope.py`) come from the config.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from services.scheduler.model.llama import CausalLM


class Phi3ForCausalLM(CausalLM):
    def checkpoint_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter under its own name: the fused projections are the checkpoint's too."""
        yield from self.named_parameters()
