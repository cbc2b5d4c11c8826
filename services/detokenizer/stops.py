"""Stop strings for one request, found across token boundaries.

Text that could still be the start of a stop string is held back, so the emitted deltas
concatenate to exactly the final text whether or not a stop string completes later.

`min_tokens` (vLLM's meaning): text of the first `min_tokens` output tokens is *protected* — a
match whose last character lies in it is no stop, while one that starts in it and ends after it
is. Protected text is always a prefix of the stream, so one offset says where it ends.
"""

from __future__ import annotations

from collections.abc import Sequence


class StopMatcher:
    def __init__(self, stops: Sequence[str], keep_stop: bool = False) -> None:
        self._stops = tuple(stop for stop in stops if stop)
        self._keep_stop = keep_stop  # `no_stop_trim`: the matched string stays in the text
        self._max_held = max((len(stop) for stop in self._stops), default=1) - 1
        self._held = ""  # never emitted; always a proper prefix of some stop string
        self._num_fed = 0  # characters fed so far (emitted + held)
        self._protected_end = 0  # stream offset: a match must end after it

    @property
    def active(self) -> bool:
        return bool(self._stops)

    def protect(self, num_ahead: int = 0) -> None:
        """Everything fed so far and the next `num_ahead` characters can no longer end a match."""
        self._protected_end = self._num_fed + num_ahead

    def feed(self, text: str) -> tuple[str, str | None]:
        """Return (text safe to emit, the matched stop string or None)."""
        hit = self.probe(text)
        self._num_fed += len(text)
        if hit is not None:
            self._held = ""
            return hit
        held = self._held + text
        num_held = self._stop_prefix_len(held)
        self._held = held[len(held) - num_held :]
        return held[: len(held) - num_held], None

    def probe(self, text: str) -> tuple[str, str] | None:
        """Like `feed` when `text` completes a stop string, else None; changes nothing."""
        held = self._held + text
        match = self._earliest_match(held, self._protected_end - (self._num_fed - len(self._held)))
        if match is None:
            return None
        index, stop = match
        return held[: index + len(stop) if self._keep_stop else index], stop

    def flush(self) -> str:
        """The request ended without a match: release what was held."""
        held, self._held = self._held, ""
        return held

    def _earliest_match(self, text: str, num_protected: int) -> tuple[int, str] | None:
        """The first match in `text` whose end lies past its first `num_protected` characters."""
        starts = ((stop, max(0, num_protected - len(stop) + 1)) for stop in self._stops)
        found = [(index, stop) for stop, start in starts if (index := text.find(stop, start)) >= 0]
        return min(found, key=lambda hit: (hit[0], -len(hit[1])), default=None)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with."""
        for size in range(min(len(text), self._max_held), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0
