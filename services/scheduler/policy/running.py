"""The running sequences, oldest first, and what they share, counted as they join and leave."""

from __future__ import annotations

from typing import NoReturn

from services.scheduler.plan import SeqStep, StepPlan
from services.scheduler.policy.sequence import Sequence


class RunningSet(dict):
    """A dict (seq -> None) as an ordered set, by identity (`Sequence` has eq=False), so membership
    and removal are O(1); a dict subclass, so `in`, iteration and `len` stay the dict's own (asked
    per sequence per step). Sequences join and leave through `add` and `remove` (never
    `running[seq] = ...` or `del`), which count what the worker would otherwise ask of every
    sequence of every step: `plan` hands those counts on (`StepPlan.output_logprob_keys`,
    `processes_logits`, `samples_randomly`); the dict's other ways in and out raise, so no change
    can skip the counts."""

    def __init__(self) -> None:
        super().__init__()
        self._keys: dict[tuple[int, tuple[int, ...]] | None, int] = {}  # output_logprob_key -> running sequences
        self._num_processing = 0  # running sequences whose logits a processor changes
        self._num_random = 0  # running sequences that sample (temperature > 0)

    def add(self, seq: Sequence) -> None:
        dict.__setitem__(self, seq, None)
        params = seq.params
        self._keys[params.output_logprob_key] = self._keys.get(params.output_logprob_key, 0) + 1
        self._num_processing += params.processes_logits
        self._num_random += params.samples_randomly

    def remove(self, seq: Sequence) -> None:
        dict.__delitem__(self, seq)
        params = seq.params
        key = params.output_logprob_key
        if self._keys[key] == 1:
            del self._keys[key]
        else:
            self._keys[key] -= 1
        self._num_processing -= params.processes_logits
        self._num_random -= params.samples_randomly

    def clear(self) -> None:
        super().clear()
        self._keys.clear()
        self._num_processing = 0
        self._num_random = 0

    def _uncounted(self, *args: object, **kwargs: object) -> NoReturn:
        raise TypeError("RunningSet: sequences join and leave through add() and remove(), which keep its counts")

    __setitem__ = __delitem__ = __ior__ = pop = popitem = setdefault = update = _uncounted

    def plan(self, steps: list[SeqStep]) -> StepPlan:
        """A plan of running sequences only, with what they share (counted now)."""
        return StepPlan(steps, tuple(self._keys), self._num_processing > 0, self._num_random > 0)
