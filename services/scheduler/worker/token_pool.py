"""Each sequence's last sampled token, kept on the device.

The step that samples a token puts it here (`put`); the step whose query begins with it (the
sequence's next decode or verify: `SeqStep.from_pool`) takes it from here (`input_ids`), whether
or not the host has read it back yet. So the next step can be planned from host state alone and
launched while this one runs: nothing is waited for, no query token stands in for another.

A request holds one row from its first sampled token until `release`. A row freed while a step
that writes it is still queued is safe to hand out again: the device runs steps in order on one
stream, and its next holder writes it (its first sampled token) before any step reads it.
"""

from __future__ import annotations

import numpy as np
import torch

from services.scheduler.plan import StepPlan
from services.scheduler.worker.layout import StepLayout

INITIAL_ROWS = 64


class TokenPool:
    def __init__(self, device: torch.device) -> None:
        self.tokens = torch.zeros(INITIAL_ROWS, dtype=torch.int64, device=device)  # int64 [rows]
        self._rows: dict[str, int] = {}  # rid -> its row
        self._free: list[int] = list(range(INITIAL_ROWS - 1, -1, -1))

    def release(self, rid: str) -> None:
        row = self._rows.pop(rid, None)
        if row is not None:
            self._free.append(row)

    def host_arrays(self, plan: StepPlan, layout: StepLayout) -> dict[str, np.ndarray]:
        """The step's pool rows: `pool_rows` int64 [F] of its from-pool queries and `pool_positions`
        int64 [F], their query rows (left out where every query is one from-pool token, in order: a
        decode step), then `put_rows` int64 [P], each producer's row (left out where they are
        `pool_rows`: a decode step again). A producer's first token takes it a row."""
        steps = plan.steps
        pooled = [i for i, s in enumerate(steps) if s.from_pool]
        arrays = {}
        if pooled:
            arrays["pool_rows"] = np.fromiter([self._rows[steps[i].rid] for i in pooled], np.int64, len(pooled))
            if not (layout.verifies_every_row and len(pooled) == len(steps)):
                arrays["pool_positions"] = np.asarray([layout.row_start[i] for i in pooled], np.int64)
        if layout.producers and pooled != layout.producers:
            rows = map(self._row_of, (steps[i].rid for i in layout.producers))
            arrays["put_rows"] = np.fromiter(rows, np.int64, len(layout.producers))
        return arrays

    def input_ids(self, arrays: dict[str, torch.Tensor]) -> torch.Tensor:
        """[T]: the step's query tokens, the from-pool ones copied in from the pool."""
        if "pool_rows" not in arrays:
            return arrays["input_ids"]
        tokens = self.tokens[arrays["pool_rows"]]  # [F]
        if "pool_positions" not in arrays:
            return tokens  # every query is one of them, in order
        return arrays["input_ids"].index_copy(0, arrays["pool_positions"], tokens)

    def put(self, arrays: dict[str, torch.Tensor], next_token: torch.Tensor) -> None:
        """Each producer's new last token (next_token int64 [P]) into its row."""
        rows = arrays["put_rows"] if "put_rows" in arrays else arrays["pool_rows"]
        self.tokens.index_copy_(0, rows, next_token)

    def _row_of(self, rid: str) -> int:
        row = self._rows.get(rid)
        if row is None:
            if not self._free:
                self._grow()
            row = self._rows[rid] = self._free.pop()
        return row

    def _grow(self) -> None:
        size = self.tokens.shape[0]
        self.tokens = torch.cat([self.tokens, torch.zeros_like(self.tokens)])  # queued after every earlier use
        self._free.extend(range(2 * size - 1, size - 1, -1))
