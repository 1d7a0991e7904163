"""Time is injected: the core never reads the wall clock.

The simulator passes its virtual clock; the runtime passes a wall clock it
owns; tests pass :class:`ManualClock`.
"""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> float: ...


class ManualClock:
    """A clock that moves only when told to."""

    __slots__ = ("_t",)

    def __init__(self, start: float = 0.0) -> None:
        self._t = float(start)

    def now(self) -> float:
        return self._t

    def advance(self, seconds: float) -> float:
        if seconds < 0:
            raise ValueError("time does not go backwards")
        self._t += seconds
        return self._t

    def set(self, t: float) -> None:
        if t < self._t:
            raise ValueError(f"time does not go backwards ({t} < {self._t})")
        self._t = float(t)
