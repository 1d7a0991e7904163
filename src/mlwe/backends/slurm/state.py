"""The Slurm backend's bookkeeping, shared by the modules that make up the backend.

- the records of an attempt and its replicas (:class:`_Attempt`, :class:`_Replica`);
- :class:`_SlurmState`, the base of :class:`~mlwe.backends.slurm.backend.SlurmBackend`:
  the state every part of the backend reads (declared here, set in
  ``SlurmBackend.__init__``), and how it emits events and records errors.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from mlwe.backends.slurm.commands import SlurmCommands, SlurmJobInfo
from mlwe.backends.slurm.config import SlurmBackendConfig
from mlwe.core.backend import Event, Fact, Telemetry
from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger("mlwe.slurm")

EXIT_START_FAILED = 125


class _Clock(Protocol):
    def now(self) -> float: ...


@dataclass
class _Replica:
    index: int
    node: str
    offset: int = 0
    partial: bytes = b""
    started: bool = False
    exit: dict[str, Any] | None = None


@dataclass
class _Attempt:
    workload: str
    attempt: int
    correlation_id: str | None
    dir: Path
    replicas: dict[int, _Replica]
    gpus_per_replica: int = 0
    job_id: int | None = None
    submitted_at: float = 0.0  # monotonic
    submit_error: str | None = None
    slurm: list[SlurmJobInfo] = field(default_factory=list)  # the job's components, last seen
    seen_in_squeue: bool = False
    started_emitted: bool = False
    pending_progress: tuple[float, bool] | None = None
    last_progress: float | None = None
    checkpoint: float | None = None
    stop_requested: bool = False
    grace_s: float = 0.0
    stop_sent: bool = False
    force_at: float | None = None  # monotonic: when the force is due
    forced: bool = False
    gang_broken: bool = False
    final: bool = False
    lost: bool = False
    adopted: bool = False
    started_s: float | None = None  # submit -> Started, seconds
    stop_wait_s: float | None = None  # slowest replica's SIGTERM -> exit

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(r.node for r in self.replicas.values()))



class _SlurmState:
    """What every part of the Slurm backend shares: its state, events and errors.

    The attributes are set in ``SlurmBackend.__init__``; the backend's parts are
    stacked on this base, one module each: the replicas' record files
    (:mod:`.reports`), Slurm's nodes (:mod:`.nodes`), and jobs and the protocol
    (:mod:`.backend`)."""

    cluster: ClusterSpec
    config: SlurmBackendConfig
    clock: _Clock
    slurm: SlurmCommands
    _iid: str
    _n: itertools.count[int]
    _lock: threading.RLock
    _wake: threading.Event
    event_listeners: list[Callable[[], None]]
    _events: list[Event]
    _telemetry: deque[Telemetry]
    _attempts: dict[tuple[str, int], _Attempt]
    _work: queue.SimpleQueue[tuple[str, Any]]
    errors: deque[str]
    _specs: dict[str, NodeSpec]
    _down: dict[str, bool]
    _gres: dict[str, str]
    _not_responding: dict[str, float]
    _next_squeue: float

    def _emit(self, fact: Fact, correlation_id: str | None = None) -> None:
        self._events.append(
            Event(f"slurm-{self._iid}-{next(self._n)}", self.clock.now(), fact, correlation_id)
        )
        self._wake.set()
        for listener in self.event_listeners:
            listener()

    def _error(self, text: str) -> None:
        log.warning("%s", text)
        self.errors.append(text)
