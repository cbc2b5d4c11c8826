"""Work the core runs between two steps: new weights, a pause, a memory release (RL loops).

A `Control` runs on the step thread when no step is in flight, so no step ever mixes the state
before it with the state after. A draining control first lets every held request finish on the
state before (arrivals wait in the inbox until it ran); a paused core only applies aborts.
"""

from __future__ import annotations

import threading
import zlib
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.scheduler.core import SchedulerCore
    from services.scheduler.request import RequestOutput


@dataclass
class Control:
    """`run(core)` returns outputs to publish (requests it ended); `done` gets their count or the error."""

    run: Callable[[SchedulerCore], list[RequestOutput]]
    drain: bool = False  # run once no request is held
    done: Future = field(default_factory=Future)


class BetweenSteps:
    """The controls waiting for the step thread, and the state they change."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._waiting: list[Control] = []
        self.paused = False  # held requests wait, arrivals stay in the inbox
        self.weight_version = "0"  # the policy version every step's outputs come from

    def add(self, control: Control) -> Future:
        with self._lock:
            self._waiting.append(control)
        return control.done

    @property
    def pending(self) -> bool:
        return bool(self._waiting)

    @property
    def holds_arrivals(self) -> bool:
        """Arrivals stay in the inbox: paused, or a draining control waits for the held requests."""
        return self.paused or any(control.drain for control in self._waiting)

    def fail(self, message: str) -> None:
        """The core stops (shutdown, a fatal error): every waiting control fails, nothing is held."""
        with self._lock:
            waiting, self._waiting = self._waiting, []
            self.paused = False
        for control in waiting:
            control.done.set_exception(RuntimeError(message))

    def take(self, num_held: int) -> Control | None:
        """The first control, once it may run: a draining one when nothing is held, or paused
        (requests held by a pause go on with whatever the controls leave)."""
        with self._lock:
            if not self._waiting or (self._waiting[0].drain and num_held and not self.paused):
                return None
            return self._waiting.pop(0)


def weights_changed(core: SchedulerCore, version: str) -> None:
    """The one point where the weights a step reads change (between steps): whatever was computed
    from the old ones (a prefix cache's blocks) is dropped here, and blocks cached from now on are
    keyed by the new version (a block of the old weights is never found again)."""
    core.controls.weight_version = version
    core.policy.blocks.cache.set_salt(zlib.crc32(version.encode()))


def flush_prefix_cache(core: SchedulerCore) -> list[RequestOutput]:
    """SGLang's /flush_cache, between steps: every cached KV block forgotten (held ones stay held)."""
    core.policy.blocks.cache.flush()
    return []
