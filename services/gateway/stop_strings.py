"""Stop strings matched across text deltas.

Text that could still be the start of a stop string is held back until the next delta settles
it, so neither the stop string nor anything after it is ever sent to the client.
"""
from __future__ import annotations

from typing import NamedTuple


class StopScan(NamedTuple):
    text: str      # safe to emit now
    stopped: bool  # a stop string was found; generation should end


class StopStringMatcher:
    def __init__(self, stops: tuple[str, ...]):
        self._stops = tuple(stop for stop in stops if stop)
        self._held = ""
        self._stopped = False

    def push(self, delta: str) -> StopScan:
        if self._stopped:
            return StopScan("", True)
        if not self._stops:
            return StopScan(delta, False)
        pending = self._held + delta
        first = min((index for index in (pending.find(stop) for stop in self._stops)
                     if index >= 0), default=-1)
        if first >= 0:
            self._held, self._stopped = "", True
            return StopScan(pending[:first], True)
        keep = self._partial_match_length(pending)
        self._held = pending[len(pending) - keep:] if keep else ""
        return StopScan(pending[:len(pending) - keep], False)

    def finish(self) -> str:
        """Held text at the end of generation: no stop string completed it, so it is output."""
        held, self._held = self._held, ""
        return "" if self._stopped else held

    def _partial_match_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
