"""The runtime's clocks: wall time, optionally sped up for demos.

The core never reads the wall clock (DESIGN convention 6); the runtime owns
the one it passes in. Deadlines in specs are absolute seconds since the epoch,
so the default clock is ``time.time()``; a ``speed`` above 1 makes a demo's
hours pass in minutes while staying monotonic.
"""

from __future__ import annotations

import threading
import time


class WallClock:
    """Seconds since the epoch, ``speed`` times faster than real time from the start."""

    def __init__(self, speed: float = 1.0, start: float | None = None) -> None:
        if not speed > 0:
            raise ValueError(f"clock speed must be positive, got {speed!r}")
        self.speed = float(speed)
        self._t0 = time.time() if start is None else float(start)
        self._m0 = time.monotonic()
        self._last = self._t0
        self._lock = threading.Lock()

    def now(self) -> float:
        t = self._t0 + (time.monotonic() - self._m0) * self.speed
        with self._lock:  # never backwards, even across threads
            if t < self._last:
                t = self._last
            self._last = t
        return t

    def real_seconds(self, engine_seconds: float) -> float:
        """How long ``engine_seconds`` of engine time takes in real time."""
        return engine_seconds / self.speed
