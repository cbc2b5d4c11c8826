"""The drafter's q of each sampled request's pending block, kept from the step that drafted it to
the step that verifies it (the accept rule reads q(d) and the residual max(p - q, 0))."""

from __future__ import annotations

import torch

from services.scheduler.plan import SeqStep, StepPlan


class DraftProbs:
    def __init__(self) -> None:
        self._probs: dict[str, torch.Tensor] = {}  # rid -> q [gamma, V] of its pending block

    def release(self, rid: str) -> None:
        self._probs.pop(rid, None)

    def keep(self, plan: StepPlan, producers: list[int], proposal) -> None:
        """A proposal's q [P, gamma, V] of the sampled producers (plan.steps[producers[p]]). A row kept
        as a view would keep the whole batch's q alive (greedy rows too) until its request drafts again:
        with greedy rows beside them, the sampled rows are gathered into a tensor of their own."""
        if proposal is None or proposal.probs is None:
            return
        sampled = [p for p, i in enumerate(producers) if plan.steps[i].params.samples_randomly]
        probs = proposal.probs
        if sampled and len(sampled) < probs.shape[0]:
            probs = torch.stack([probs[p] for p in sampled])  # [S, gamma, V]; no index upload
        for row, p in enumerate(sampled):
            self._probs[plan.steps[producers[p]].rid] = probs[row]

    def stacked(self, producers: list[SeqStep], drafts: torch.Tensor, vocab: int) -> torch.Tensor | None:
        """q [P, K, V] of the blocks being verified; None when every block came without q (point masses)."""
        num_slots = drafts.shape[1]
        stored = [self._probs.get(s.rid) if s.num_draft > 0 else None for s in producers]
        if num_slots == 0 or all(q is None for q in stored):
            return None
        point_masses = torch.nn.functional.one_hot(drafts, vocab).float()  # [P, K, V]
        rows = [point_masses[p] if q is None else _fit_rows(q, num_slots) for p, q in enumerate(stored)]
        return torch.stack(rows)


def _fit_rows(q: torch.Tensor, num_slots: int) -> torch.Tensor:
    """q [gamma, V] -> [num_slots, V]: cut, or padded with copies of its last row (never read)."""
    if q.shape[0] >= num_slots:
        return q[:num_slots]
    return torch.cat([q, q[-1:].expand(num_slots - q.shape[0], -1)])
