"""One thread that drives an engine, a pipeline runner and supervisors together.

The engine's own loop (``Engine.start``) is enough for the engine; pipelines
and supervisors are driven from outside it, never from inside a tick hook:
they call the engine (submit, propose, record reasoning), which must not
happen while the tick holds the engine lock. :class:`PipelineLoop` runs
``engine.tick()`` (unless the engine runs its own loop), ``runner.advance()``
and every supervisor's ``tick()`` in turn.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence

from mlwe.pipelines.ports import EngineLike
from mlwe.pipelines.runner import PipelineRunner
from mlwe.pipelines.supervision import Supervisor

log = logging.getLogger("mlwe.pipelines.loop")


class PipelineLoop:
    def __init__(
        self,
        engine: EngineLike,
        runner: PipelineRunner,
        supervisors: Sequence[Supervisor] = (),
        *,
        period_s: float = 0.05,
        tick_engine: bool = True,
        extra: Sequence[Callable[[], None]] = (),
    ) -> None:
        self.engine = engine
        self.runner = runner
        self.supervisors = list(supervisors)
        self.period_s = period_s
        self.tick_engine = tick_engine
        self.extra = list(extra)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.iterations = 0

    def step(self) -> None:
        """One iteration: engine tick, pipeline runs, supervisors, extra callables."""
        if self.tick_engine:
            rep = self.engine.tick()
            self.errors += rep.errors
        self.runner.advance()
        for s in self.supervisors:
            s.tick()
        for fn in self.extra:
            fn()
        self.iterations += 1

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("the pipeline loop is already running")
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                try:
                    self.step()
                except Exception as exc:  # keep going; the error is kept for the caller
                    log.exception("pipeline loop iteration failed")
                    self.errors.append(f"{type(exc).__name__}: {exc}")
                self._stop.wait(self.period_s)

        self._thread = threading.Thread(target=loop, name="mlwe-pipelines", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def run_until(self, predicate: Callable[[], bool], timeout_s: float) -> bool:
        """Step on this thread until ``predicate`` holds; False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.step()
            if predicate():
                return True
            time.sleep(self.period_s)
        return False
