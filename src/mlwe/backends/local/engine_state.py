"""The LocalBackend's bookkeeping, shared by the modules that make up the backend.

- the records of an attempt, its replicas and the cluster's nodes
  (:class:`_Attempt`, :class:`_Replica`, :class:`_Node`);
- :class:`_LocalState`, the base of :class:`~mlwe.backends.local.backend.LocalBackend`:
  the state every part of the backend reads (declared here, set in
  ``LocalBackend.__init__``); it emits events and records errors as
  :class:`~mlwe.backends.common.ThreadedEvents`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.backends.common import ThreadedEvents
from mlwe.backends.local.link import _Daemon
from mlwe.core.backend import Telemetry
from mlwe.core.spec import ClusterSpec, NodeSpec

log = logging.getLogger("mlwe.local")


@dataclass
class _Replica:
    index: int
    node: str
    msg: dict[str, Any]
    state: str = "queued"  # queued -> sent -> running -> gone
    ever_started: bool = False
    stop_sent: bool = False
    code: int | None = None
    cause: str = ""
    term_to_exit_s: float | None = None


@dataclass
class _Attempt:
    workload: str
    attempt: int
    correlation_id: str | None
    replicas: dict[int, _Replica]
    started_emitted: bool = False
    final: bool = False  # its terminal fact is out (or it was lost with its node)
    lost: bool = False
    stop_requested: bool = False
    grace_s: float = 0.0
    killing: bool = False
    failure: _Replica | None = None
    checkpoint: float | None = None
    pending_progress: tuple[float, bool] | None = None
    last_progress: float | None = None
    adopted: bool = False

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)


@dataclass
class _Node:
    name: str
    spec: NodeSpec | None
    daemon: _Daemon | None = None
    down: bool = False  # NodeDown emitted and no NodeUp since
    queued: list[tuple[tuple[str, int], int]] = field(default_factory=list)


class _LocalState(ThreadedEvents):
    """What every part of the LocalBackend shares: its state, events and errors.

    The attributes are set in ``LocalBackend.__init__``; the backend's parts are
    stacked on this base, one module each: commands and attempt facts
    (:mod:`.attempts`), the daemons' messages (:mod:`.messages`), their
    connections and registration (:mod:`.registry`), and the protocol itself
    (:mod:`.backend`). The clock, the events and the errors are declared (and
    ``_emit`` and ``_error`` defined) on :class:`~mlwe.backends.common.ThreadedEvents`."""

    _event_prefix = "local"
    _log = log

    cluster: ClusterSpec | None
    token: str | None
    heartbeat_s: float
    missed_heartbeats: int
    telemetry_s: float
    report_s: float
    register_timeout_s: float
    checkpoint_root: Path | None
    _lock: threading.RLock
    _telemetry: deque[Telemetry]
    _attempts: dict[tuple[str, int], _Attempt]
    _daemons: dict[str, _Daemon]
    _nodes: dict[str, _Node]
    _closed: bool
    _closing: bool
    _t0: float
    _server: socket.socket
    _threads: list[threading.Thread]
