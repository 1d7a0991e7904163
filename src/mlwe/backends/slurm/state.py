"""The Slurm backend's bookkeeping, shared by the modules that make up the backend.

- the records of an attempt and its replicas (:class:`_Attempt`, :class:`_Replica`);
- :class:`_SlurmState`, the base of :class:`~mlwe.backends.slurm.backend.SlurmBackend`:
  the state every part of the backend reads (declared here, set in
  ``SlurmBackend.__init__``); it emits events and records errors as
  :class:`~mlwe.backends.common.ThreadedEvents`.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.backends.common import ThreadedEvents
from mlwe.backends.slurm.commands import SlurmCommands, SlurmJobInfo
from mlwe.backends.slurm.config import SlurmBackendConfig
from mlwe.core.backend import Telemetry
from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger("mlwe.slurm")

EXIT_START_FAILED = 125


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



class _SlurmState(ThreadedEvents):
    """What every part of the Slurm backend shares: its state, events and errors.

    The attributes are set in ``SlurmBackend.__init__``; the backend's parts are
    stacked on this base, one module each: the replicas' record files
    (:mod:`.reports`), Slurm's nodes (:mod:`.nodes`), and jobs and the protocol
    (:mod:`.backend`). The clock, the events and the errors are declared (and
    ``_emit`` and ``_error`` defined) on :class:`~mlwe.backends.common.ThreadedEvents`."""

    _event_prefix = "slurm"
    _log = log

    cluster: ClusterSpec
    config: SlurmBackendConfig
    slurm: SlurmCommands
    _lock: threading.RLock
    _telemetry: deque[Telemetry]
    _attempts: dict[tuple[str, int], _Attempt]
    _work: queue.SimpleQueue[tuple[str, Any]]
    _specs: dict[str, NodeSpec]
    _down: dict[str, bool]
    _gres: dict[str, str]
    _not_responding: dict[str, float]
    _next_squeue: float
