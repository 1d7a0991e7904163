"""The Ray backend's bookkeeping, shared by the modules that make up :class:`RayBackend`.

- the phases and outcomes of an attempt, and the records of an attempt, its
  replicas and the warm runner actors (:class:`_Attempt`, :class:`_Replica`,
  :class:`_Warm`);
- :class:`_BackendState`, the base of :class:`~mlwe.backends.ray.backend.RayBackend`:
  the state every part of the backend reads (declared here, set in
  ``RayBackend.__init__``) and the small helpers they share (events, names,
  errors, ready refs, summaries, whether Ray's state API is used);
- the lazy ``ray`` import and the runner's exit answer.
"""

from __future__ import annotations

import enum
import itertools
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.backends.ray.config import RayBackendConfig
from mlwe.core.backend import Event, Fact, Telemetry
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.clock import Clock
from mlwe.core.extras import missing_extra
from mlwe.core.spec import NodeSpec, WorkloadSpec

log = logging.getLogger("mlwe.backends.ray.backend")  # one logger for the whole backend


class _Phase(enum.Enum):
    PLACING = "placing"  # placement group created, waiting for Ray to reserve every bundle
    SPAWNING = "spawning"  # actors created, waiting for every program to start
    RUNNING = "running"
    STOPPING = "stopping"  # stop asked of every actor, waiting for their answers
    DRAINING = "draining"  # the programs are gone: one last sample of each replica's reports
    CONFIRMING = "confirming"  # actors killed, PG removed: waiting for Ray to confirm
    DONE = "done"


class _Outcome(enum.Enum):
    RELEASED = "released"  # a stop was asked: report Released
    EXITED = "exited"  # the program ended by itself (or could not start): report Exited
    NODE_LOST = "node-lost"  # a node died: NodeDown says it all, report nothing


@dataclass
class _Replica:
    index: int
    node: str
    name: str
    actor: Any = None
    start_ref: Any = None
    wait_ref: Any = None
    stop_ref: Any = None
    sample_ref: Any = None
    drain_refs: list[Any] = field(default_factory=list)  # last samples before the teardown
    probe_ref: Any = None
    reap_ref: Any = None
    pid: int | None = None
    ray_node_id: str | None = None  # where Ray really ran it (checked against the mapping)
    actor_pid: int | None = None  # the Ray worker process hosting the actor
    exit_code: int | None = None
    killed_by: str | None = None  # the signal that ended the program, if one did
    stop_result: dict[str, Any] | None = None
    dead: bool = False  # Ray confirmed the actor is gone
    died: str | None = None  # the actor died on its own (error text)
    died_at: float | None = None  # when an abnormal end (death, kill) was first seen
    raylet_answered: bool = False  # its node's raylet answered after that: the node lives
    actor_answered: bool = False  # its actor answered a probe after its program was killed


@dataclass
class _Warm:
    """An idle runner actor pinned to a node, started ahead of need."""

    node: str
    name: str
    actor: Any
    ready_ref: Any  # resolves once the actor runs; None after
    ready: bool = False


POOL_TAG = "~pool"  # in warm actors' names; a workload id cannot start with "~"


@dataclass
class _Attempt:
    workload: str
    attempt: int
    nodes: tuple[str, ...]
    replicas: list[_Replica]
    spec: WorkloadSpec | None
    placement: tuple[ReplicaAlloc, ...]
    correlation_id: str | None
    phase: _Phase = _Phase.PLACING
    pg: Any = None
    pg_name: str = ""
    pg_ready_ref: Any = None
    since: float = field(default_factory=time.monotonic)
    outcome: _Outcome | None = None
    exit_code: int = 0
    cause: str = ""
    stop_grace: float = 0.0
    stop_requested: bool = False
    forced: bool = False
    checkpoint_progress: float | None = None
    progress_sent: float = -1.0
    checkpoints_sent: int = 0
    error: str | None = None
    adopted: bool = False
    confirm_checks: int = 0
    t_stop: float | None = None  # monotonic time the stop was asked (for figures)
    resume_work_s: float = 0.0
    t_start: float = field(default_factory=time.monotonic)  # the start command arrived
    started_s: float | None = None  # start command -> every program running (PG + actors)
    teardown_force: bool = False  # what the teardown after draining does

    @property
    def key(self) -> tuple[str, int]:
        return (self.workload, self.attempt)


def _ray() -> Any:
    try:
        import ray
    except ImportError as exc:  # Ray is the mlwe[ray] extra
        raise missing_extra("ray", exc) from exc
    return ray


def _exit_of(value: Any) -> tuple[int, str | None]:
    """The runner's ``wait`` answer as (exit code, signal name or None)."""
    if isinstance(value, dict):
        sig = value.get("signal")
        return int(value.get("code", -1)), str(sig) if sig else None
    return int(value), None


def _api_server_url() -> str | None:
    """The dashboard's HTTP address of the cluster this process is connected to, from its
    GCS (the state API's own discovery would pick any Ray cluster it finds on the machine)."""
    try:
        from ray._private import ray_constants
        from ray.experimental.internal_kv import _internal_kv_get

        raw = _internal_kv_get(
            ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD
        )
    except Exception as exc:
        log.debug("cannot read the dashboard address: %s", exc)
        return None
    if not raw:
        return None
    text = raw.decode() if isinstance(raw, bytes) else str(raw)
    return text if "://" in text else f"http://{text}"


class _BackendState:
    """What every part of the Ray backend shares: its state and small helpers.

    The attributes are set in ``RayBackend.__init__`` (see there for what each holds);
    the backend's parts are stacked on this base, one module each: warm pool
    (:mod:`.pool`), adoption (:mod:`.adoption`), telemetry (:mod:`.telemetry`),
    stopping and teardown (:mod:`.teardown`), nodes (:mod:`.nodes`), starting and
    running (:mod:`.lifecycle`), and the protocol itself (:mod:`.backend`)."""

    config: RayBackendConfig
    clock: Clock
    node_specs: dict[str, NodeSpec]
    checkpoint_root: Path
    log_root: Path
    _uid: str
    _n: itertools.count[int]
    _events: list[Event]
    _telemetry: list[Telemetry]
    _seen: set[str]
    _attempts: dict[tuple[str, int], _Attempt]
    _reported: set[tuple[str, int]]
    _finished: OrderedDict[tuple[str, int], dict[str, Any]]
    _ray_node: dict[str, str]
    _down: set[str]
    _pending_down: dict[str, tuple[float, str]]
    _dead_ray_nodes: set[str]
    _state_api: bool | None
    _api_url: str | None
    errors: list[str]
    stop_figures: list[dict[str, float]]
    _closed: bool
    _pool: dict[str, list[_Warm]]
    _host: dict[str, dict[str, float]]
    _pool_seq: itertools.count[int]
    _runner: Any
    _reaper: Any
    event_listeners: list[Callable[[], None]]

    @staticmethod
    def _summary(a: _Attempt) -> dict[str, Any]:
        return {
            "workload": a.workload,
            "attempt": a.attempt,
            "phase": a.phase.value,
            "outcome": a.outcome.value if a.outcome else None,
            "exit_code": a.exit_code if a.outcome is _Outcome.EXITED else None,
            "cause": a.cause,
            "forced": a.forced,
            "checkpoint_progress": a.checkpoint_progress,
            "placement_group": a.pg_name,
            "adopted": a.adopted,
            "started_s": a.started_s,
            # seconds from SIGTERM to the program's exit (its checkpoint), slowest replica
            "stop_wait_s": max(
                (float(r.stop_result.get("stop_s", 0.0)) for r in a.replicas if r.stop_result),
                default=None,
            ),
            "replicas": [
                {"index": r.index, "node": r.node, "actor": r.name, "pid": r.pid,
                 "actor_pid": r.actor_pid, "ray_node_id": r.ray_node_id,
                 "exit_code": r.exit_code}
                for r in a.replicas
            ],
        }

    # ================================================================ helpers
    def _emit(self, fact: Fact, correlation_id: str | None = None) -> None:
        self._events.append(
            Event(f"ray-{self._uid}-{next(self._n)}", self.clock.now(), fact, correlation_id)
        )

    def _actor_name(self, workload: str, attempt: int, replica: int) -> str:
        return f"{self.config.prefix}:{workload}:{attempt}:{replica}"

    def _pg_name(self, workload: str, attempt: int) -> str:
        return f"{self.config.prefix}:{workload}:{attempt}"

    def _error(self, text: str) -> None:
        log.warning("%s", text)
        self.errors.append(text)
        del self.errors[:-200]

    def _get(self, ref: Any) -> tuple[bool, Any]:
        """(True, value) or (False, the Ray error) for a ready ref."""
        ray = _ray()
        try:
            return True, ray.get(ref, timeout=0)
        except ray.exceptions.RayError as exc:
            return False, exc

    def _probe(self, rep: _Replica, ready: set[Any]) -> tuple[bool, Any] | None:
        """Ask ``rep``'s actor for its ``info``: None while the answer is outstanding
        (a probe is sent if none is), else whether Ray says the actor died (an actor
        error other than its being unavailable for now) and the answer or the error.
        A probe answered is spent: the next call sends another."""
        if rep.probe_ref is None:
            rep.probe_ref = rep.actor.info.remote()
            return None
        if rep.probe_ref not in ready:
            return None
        ok, value = self._get(rep.probe_ref)
        rep.probe_ref = None
        ray = _ray()
        dead = not ok and isinstance(value, ray.exceptions.RayActorError) and not isinstance(
            value, ray.exceptions.ActorUnavailableError)
        return dead, value

    def _kill_quietly(self, actor: Any) -> None:
        try:
            _ray().kill(actor, no_restart=True)
        except Exception as exc:
            log.debug("ray.kill: %s", exc)

    def _use_state_api(self) -> bool:
        if self._state_api is None:
            self._api_url = _api_server_url()
            if self._api_url is None:
                self._state_api = False  # no dashboard: no state API
            else:
                try:
                    from ray.util.state import list_nodes

                    list_nodes(address=self._api_url, limit=1, timeout=5)
                    self._state_api = True
                except Exception as exc:
                    log.info("Ray state API unavailable (%s): release is confirmed from refs", exc)
                    self._state_api = False
        return self._state_api
