"""What the backends share: the wall clock they read unless given one, and how the
local and Slurm backends emit events and record errors.

- :class:`WallClock`: ``time.time()``, every backend's default clock;
- :class:`ThreadedEvents`, a base of the local and Slurm backends' state
  (:class:`~mlwe.backends.local.engine_state._LocalState`,
  :class:`~mlwe.backends.slurm.state._SlurmState`): their threads produce the events,
  so ``_emit`` also wakes :meth:`wait` and calls the ``event_listeners``, and
  ``_error`` logs and keeps the text in ``errors`` (a bounded deque).

The Ray backend produces its events inside ``poll``: its ``_emit`` wakes no one and its
``errors`` is a list cut to its last 200, so it keeps its own (in
:mod:`mlwe.backends.ray.state`).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import ClassVar

from mlwe.core.backend import Event, Fact
from mlwe.core.clock import Clock


class WallClock:
    """The wall clock (``time.time()``): a backend's clock unless it is given one."""

    def now(self) -> float:
        return time.time()


class ThreadedEvents:
    """The events and errors of a backend whose own threads produce its events.

    A subclass names its ``_event_prefix`` (the events' ids are
    ``PREFIX-INSTANCE-N``) and its ``_log``; the backend's ``__init__`` sets the
    attributes declared here."""

    _event_prefix: ClassVar[str]
    _log: ClassVar[logging.Logger]
    clock: Clock
    _iid: str
    _n: itertools.count[int]
    _wake: threading.Event
    event_listeners: list[Callable[[], None]]
    _events: list[Event]
    errors: deque[str]

    def _emit(self, fact: Fact, correlation_id: str | None = None) -> None:
        self._events.append(
            Event(f"{self._event_prefix}-{self._iid}-{next(self._n)}", self.clock.now(), fact,
                  correlation_id)
        )
        self._wake.set()
        for listener in self.event_listeners:
            listener()

    def _error(self, text: str) -> None:
        self._log.warning("%s", text)
        self.errors.append(text)
