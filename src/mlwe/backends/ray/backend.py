"""RayBackend: the Backend protocol on a Ray cluster.

The control plane decides placement; Ray only executes it:

- **Placement.** Every attempt gets a named, detached placement group with one
  bundle per replica. A bundle asks one unit of ``mlwe_node:<node>`` (pinning
  it to the node the control plane chose, see :mod:`.cluster`), the replica's
  GPUs (Ray's ``GPU`` and ``gpu_model:<model>``, so Ray's own accounting agrees
  with ours and a card still held by a dying process is never handed out
  twice) and nothing else (CPU and memory are the control plane's accounting).
  The strategy is STRICT_SPREAD when every replica is on a different Ray node,
  PACK otherwise; either way Ray reserves all bundles at once or none, so a
  gang starts whole or not at all.
- **Execution.** Each replica is a detached, threaded :class:`ReplicaRunner`
  actor in its bundle that runs the workload's command as a real process tree
  (see :mod:`.runner`) with the local daemon's environment. When every
  replica's program runs, ``Started`` is reported.
- **Stopping.** A :class:`StopCommand` asks every replica to stop: SIGTERM,
  ``grace_s`` for a checkpoint, then SIGKILL of the process group (``grace_s
  == 0``: SIGKILL at once). If an actor does not answer within the grace plus
  ``stop_margin_s``, it is killed with ``ray.kill`` and a task pinned to its node
  SIGKILLs the program's process group. Then the actors are killed and the
  placement group removed, and ``Released`` is reported only once Ray confirms
  it: a call on each actor fails with ``RayActorError`` (and the state API says
  DEAD, when the dashboard is up) and the placement group's state is REMOVED.
- **Exits.** When every replica's program exited 0, or one exited non-zero (the
  others are then killed: a gang is broken), the attempt is torn down the same
  way and ``Exited`` is reported once Ray confirms it.
- **Nodes.** Ray's node table is watched; a Ray node serving an mlwe node that
  dies becomes ``NodeDown`` (after the attempts that had a replica there are
  torn down, so their surviving replicas no longer hold other nodes), and one
  that comes back, ``NodeUp``. The reconciler turns ``NodeDown`` into node-lost
  exits; this backend reports nothing more for those attempts.
- **Telemetry.** Every ``telemetry_period_s``: per replica, CPU and RSS of the
  process tree (psutil, in the actor) and the workload helper's latest report
  (loss, step, metrics); GPU figures are the declared allocation (labelled
  so); per node, whether its Ray node is alive and, from the state API, how
  many actors are alive on it. The helper's progress and checkpoints become
  ``Progress`` facts.
- **Idempotence and restarts.** Commands are deduplicated by request id, and a
  start for an attempt already running is a no-op. Actors and placement groups
  are detached and named ``<prefix>:<workload>:<attempt>[:<replica>]``, so after
  an engine restart :meth:`RayBackend.inventory` finds what still runs and
  adopts it (its exits and stops are then handled like any other).

Everything happens in :meth:`RayBackend.send` and :meth:`RayBackend.poll` on the
engine's thread with non-blocking Ray calls (``ray.wait(timeout=0)``): only they
touch the backend's state. The backend has one thread of its own, a watcher: the
first :meth:`~RayBackend.poll` that finds ``event_listeners`` registered starts it
(the runtime engine always registers its wake-up there, so under the engine it
runs), and it lives until :meth:`~RayBackend.close`, even if the listeners are
removed. It blocks in ``ray.wait`` on the refs still pending and only calls the
listeners when one is ready; it never touches the backend's state. A backend
that never had listeners (tests, benchmarks driving ``poll`` themselves) starts
no thread; Ray's own client, once connected (``ray.init``), runs threads of its
own in this process either way.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlwe.backends.ray.cluster import (
    LocalRayCluster,
    check_reachable,
    node_problems,
    node_resource,
    ray_node_table,
)
from mlwe.backends.ray.runner import ReplicaRunner, kill_groups
from mlwe.core.actions import Exited, Progress, Released, Started
from mlwe.core.backend import (
    Command,
    Event,
    Fact,
    NodeDown,
    NodeUp,
    RunningAttempt,
    StartCommand,
    StopCommand,
    Telemetry,
    dispatch,
)
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.clock import Clock
from mlwe.core.extras import missing_extra
from mlwe.core.spec import ClusterSpec, NodeSpec, WorkloadSpec

log = logging.getLogger(__name__)

NODE_DEATH_SETTLE_S = 60.0  # how long an actor death blamed on its node waits for the node


class _WallClock:
    def now(self) -> float:
        return time.time()


@dataclass
class RayBackendConfig:
    """How the Ray backend connects and behaves (every figure in seconds)."""

    #: Ray address ("auto", "HOST:PORT"); "local": start a Ray cluster on this machine with
    #: one Ray node per mlwe node (fake GPUs), owned and shut down by the backend; None: this
    #: process must already be connected (``ray.init``)
    address: str | None = None
    namespace: str = "mlwe"  # Ray namespace used when this backend connects
    prefix: str = "mlwe"  # names of actors and placement groups: <prefix>:<workload>:<attempt>
    checkpoint_root: str | None = None  # shared storage for checkpoints; default ./.mlwe/ray
    log_root: str | None = None  # programs' stdout/stderr; default <checkpoint_root>/../logs
    start_timeout_s: float = 120.0  # placement group + actors + programs started
    stop_margin_s: float = 15.0  # beyond grace_s before an unanswering actor is ray.kill-ed
    confirm_timeout_s: float = 60.0  # after the kill: Ray must confirm the actors gone by then
    node_settle_s: float = 15.0  # NodeDown waits at most this long for its attempts' teardown
    #: an actor death its node's death does not explain within this is the workload's error
    #: (an actor on a dying node can be reported dead a moment before the node is)
    actor_death_settle_s: float = 3.0
    telemetry_period_s: float = 1.0
    node_check_period_s: float = 0.25
    progress_step: float = 0.01  # progress is reported when it moved this much (or checkpointed)
    use_state_api: bool | None = None  # None: when the dashboard answers
    runner_concurrency: int = 4  # threads per replica actor (wait, sample, stop at once)
    #: idle runner actors kept started on each node: a start then takes one instead of
    #: waiting for Ray to start a worker process (~1 s); each is used once and replaced
    warm_runners_per_node: int = 1
    close_grace_s: float = 5.0
    #: a last sample (final reports) that takes longer is given up: the actor may be stuck,
    #: and the attempt's release waits on it (a loaded machine can need more)
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if ":" in self.prefix or not self.prefix:
            raise ValueError(f"prefix {self.prefix!r} must be non-empty and contain no ':'")
        for name in ("start_timeout_s", "confirm_timeout_s", "telemetry_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("stop_margin_s", "node_settle_s", "node_check_period_s", "close_grace_s",
                     "actor_death_settle_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)!r}")
        if not 0 < self.progress_step <= 1:
            raise ValueError(f"progress_step must be in (0, 1], got {self.progress_step!r}")
        if self.warm_runners_per_node < 0:
            raise ValueError("warm_runners_per_node must not be negative")
        if self.runner_concurrency < 3:
            raise ValueError("runner_concurrency must be at least 3 (wait, sample and stop)")


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


class RayBackend:
    """The Backend protocol on a Ray cluster (see the module docstring)."""

    name = "ray"

    def __init__(
        self,
        cluster: ClusterSpec | Iterable[NodeSpec],
        config: RayBackendConfig | None = None,
        *,
        clock: Clock | None = None,
    ) -> None:
        self.config = config or RayBackendConfig()
        self.clock: Clock = clock or _WallClock()
        specs = cluster.all_nodes() if isinstance(cluster, ClusterSpec) else list(cluster)
        self.node_specs: dict[str, NodeSpec] = {n.name: n for n in specs}
        ray = _ray()
        self._owns_connection = False
        self.local_cluster: LocalRayCluster | None = None
        if not ray.is_initialized() and self.config.address == "local":
            self.local_cluster = LocalRayCluster(specs, namespace=self.config.namespace)
        elif not ray.is_initialized():
            address = self.config.address or os.environ.get("RAY_ADDRESS")
            if not address:
                raise ValueError(
                    "the Ray backend needs a Ray cluster: give its address (RayBackendConfig"
                    ".address or RAY_ADDRESS, e.g. 'HOST:6380'), or 'local' to start one here"
                )
            check_reachable(address)
            ray.init(
                address=address,
                namespace=self.config.namespace,
                logging_level=logging.WARNING,
                log_to_driver=False,
            )
            self._owns_connection = True
        root = Path(self.config.checkpoint_root or Path.cwd() / ".mlwe" / "ray" / "checkpoints")
        self.checkpoint_root = root.resolve()
        self.log_root = Path(self.config.log_root or self.checkpoint_root.parent / "logs").resolve()
        self._uid = uuid.uuid4().hex[:12]
        self._n = itertools.count(1)
        self._events: list[Event] = []
        self._telemetry: list[Telemetry] = []
        self._seen: set[str] = set()
        self._attempts: dict[tuple[str, int], _Attempt] = {}
        self._reported: set[tuple[str, int]] = set()  # attempts whose final fact was reported
        self._finished: OrderedDict[tuple[str, int], dict[str, Any]] = OrderedDict()
        self._ray_node: dict[str, str] = {}  # mlwe node -> Ray node id (alive)
        self._down: set[str] = set()
        self._pending_down: dict[str, tuple[float, str]] = {}  # node -> (since, reason)
        #: Ray nodes whose raylet we found gone before the GCS said so (see _raylet_gone)
        self._dead_ray_nodes: set[str] = set()
        self._next_node_check = 0.0
        self._next_telemetry = 0.0
        self._state_api: bool | None = self.config.use_state_api
        self._api_url: str | None = _api_server_url() if self._state_api else None
        self.errors: list[str] = []  # start failures and oddities, newest last (for humans)
        self.stop_figures: list[dict[str, float]] = []  # per stop: seconds signal -> released
        self._closed = False
        #: Called (from the watcher thread) when a result the backend waits for is ready:
        #: the runtime engine registers its wake-up here and polls at once, instead of
        #: at its next tick. The first poll with a listener here starts the watcher
        #: (until close); while none was ever registered, no thread is started.
        self.event_listeners: list[Callable[[], None]] = []
        self._watch_refs: list[Any] = []
        self._watch_fresh = threading.Event()
        self._watcher: threading.Thread | None = None
        self._pool: dict[str, list[_Warm]] = {}  # node -> warm runner actors
        self._host: dict[str, dict[str, float]] = {}  # node -> last host sample from an actor
        self._pool_seq = itertools.count(1)
        runner_cls = ray.remote(ReplicaRunner)
        self._runner = runner_cls
        self._reaper = ray.remote(num_cpus=0, max_retries=0)(_reap_groups)
        try:
            self._check_nodes(initial=True)
        except BaseException:
            if self._owns_connection:
                ray.shutdown()
            if self.local_cluster is not None:
                self.local_cluster.shutdown()
            raise

    # ================================================================ protocol
    def send(self, commands: Sequence[Command]) -> None:
        dispatch(commands, self._seen, self._start, self._stop)

    def poll(self) -> list[Event]:
        now = time.monotonic()
        if now >= self._next_node_check:
            self._next_node_check = now + self.config.node_check_period_s
            self._check_nodes()
            self._refill_pool()
        self._advance()
        if time.monotonic() >= self._next_telemetry:
            self._next_telemetry = time.monotonic() + self.config.telemetry_period_s
            self._sample()
        self._flush_node_downs()
        if self.event_listeners:
            self._watch()
        out, self._events = self._events, []
        return out

    def drain_telemetry(self) -> list[Telemetry]:
        out, self._telemetry = self._telemetry, []
        return out

    def inventory(self) -> list[RunningAttempt]:
        """Attempts holding resources on Ray now, adopting any this instance did not start."""
        self._adopt()
        return [
            RunningAttempt(a.workload, a.attempt, a.nodes)
            for a in self._attempts.values()
            if a.phase is not _Phase.DONE and a.outcome is None
        ]

    def close(self) -> None:
        """Stop every attempt this backend runs (and any left by an earlier engine), then
        wait until Ray confirms them gone."""
        if self._closed:
            return
        self._closed = True
        if self._watcher is not None:  # it leaves its ray.wait within half a second
            self._watch_fresh.set()
            self._watcher.join(timeout=5.0)
            self._watcher = None
        ray = _ray()
        if ray.is_initialized():
            try:
                self._adopt()
            except Exception:  # a half-dead cluster must not stop the close
                log.warning("could not list running actors on close", exc_info=True)
            for a in list(self._attempts.values()):
                if a.phase is not _Phase.DONE and a.outcome is None:
                    self._begin_stop(a, self.config.close_grace_s, _Outcome.RELEASED)
            deadline = time.monotonic() + self.config.close_grace_s + self.config.stop_margin_s + 30
            while time.monotonic() < deadline and any(
                a.phase is not _Phase.DONE for a in self._attempts.values()
            ):
                self._advance()
                time.sleep(0.02)
            left = [f"{w}#{n}" for (w, n), a in self._attempts.items() if a.phase is not _Phase.DONE]
            if left:
                log.warning("Ray backend closed with attempts not confirmed gone: %s", left)
            self._drain_pool()
        if self._owns_connection and ray.is_initialized():
            ray.shutdown()
        if self.local_cluster is not None:
            self.local_cluster.shutdown()
            self.local_cluster = None

    def describe(self) -> list[dict[str, Any]]:
        """Live attempts and the most recently finished ones, for humans and tests."""
        return [
            *(self._summary(a) for a in self._attempts.values()),
            *self._finished.values(),
        ]

    def warm_runners(self, node: str) -> int:
        """Warm runner actors ready on ``node`` now."""
        return sum(1 for w in self._pool.get(node, ()) if w.ready)

    def attempt_info(self, workload: str, attempt: int) -> dict[str, Any] | None:
        key = (workload, attempt)
        att = self._attempts.get(key)
        return self._summary(att) if att is not None else self._finished.get(key)

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

    # ================================================================ nodes
    def _check_nodes(self, *, initial: bool = False) -> None:
        alive: dict[str, tuple[str, dict[str, float]]] = {}
        for name, entries in ray_node_table().items():
            for node_id, is_alive, res in entries:
                if is_alive and node_id not in self._dead_ray_nodes:
                    alive[name] = (node_id, res)
        if initial:
            problems = [
                p
                for name, spec in self.node_specs.items()
                if name in alive
                for p in node_problems(spec, alive[name][1])
            ]
            if problems:
                raise ValueError("Ray cluster does not match the cluster spec: " + "; ".join(problems))
        for name in self.node_specs:
            got = alive.get(name)
            was = self._ray_node.get(name)
            if got is not None and was is not None and was != got[0] and name not in self._down:
                # replaced between two checks: the Ray node we knew died
                self._node_lost(name, f"Ray node {was[:12]} died (replaced by {got[0][:12]})")
            if got is None:
                if name not in self._down:
                    reason = (
                        f"no Ray node advertises {node_resource(name)}"
                        if was is None
                        else f"Ray node {was[:12]} died"
                    )
                    self._node_lost(name, reason)
                self._ray_node.pop(name, None)
                continue
            self._ray_node[name] = got[0]
            if name in self._down and name not in self._pending_down:
                # back (a NodeDown still waiting to be reported goes first)
                self._down.discard(name)
                self._emit(NodeUp(name))

    def _node_lost(self, name: str, reason: str) -> None:
        self._down.add(name)
        for warm in self._pool.pop(name, []):
            self._kill_quietly(warm.actor)
        self._pending_down[name] = (time.monotonic(), reason)
        for a in self._attempts.values():
            if a.outcome is _Outcome.EXITED and a.exit_code == 0:
                continue  # every replica had exited 0 before the node died: it succeeded
            if name in a.nodes and a.phase is not _Phase.DONE and a.outcome is not _Outcome.NODE_LOST:
                # its replicas elsewhere must go too: the reconciler frees the whole gang
                a.outcome = _Outcome.NODE_LOST
                a.cause = "node-lost"
                self._begin_teardown(a, force=True, drain=False)

    def _flush_node_downs(self) -> None:
        now = time.monotonic()
        for name, (since, reason) in list(self._pending_down.items()):
            # the attempts it ended go first, and so does a success it did not undo: the
            # reconciler reads NodeDown as the end of whatever still runs there
            busy = any(
                name in a.nodes and a.phase is not _Phase.DONE and (
                    a.outcome is _Outcome.NODE_LOST
                    or (a.outcome is _Outcome.EXITED and a.exit_code == 0))
                for a in self._attempts.values()
            )
            if busy and now - since < self.config.node_settle_s:
                continue
            if busy:
                self._error(f"node {name}: attempts not confirmed gone {self.config.node_settle_s}s"
                            " after its Ray node died; reporting it down anyway")
            del self._pending_down[name]
            self._emit(NodeDown(name, reason))

    # ================================================================ start
    def _start(self, c: StartCommand) -> None:
        key = (c.workload, c.attempt)
        if key in self._attempts or key in self._reported:
            return  # already running (or done): a start is idempotent
        nodes = tuple(a.node for a in c.placement)
        att = _Attempt(
            c.workload, c.attempt, nodes,
            [_Replica(i, a.node, self._actor_name(c.workload, c.attempt, i))
             for i, a in enumerate(c.placement)],
            c.spec, c.placement, c.correlation_id, resume_work_s=c.resume_work_s,
        )
        self._attempts[key] = att
        unknown = [n for n in nodes if n not in self.node_specs]
        if not c.placement or unknown:
            why = "no placement" if not c.placement else f"unknown node(s) {', '.join(unknown)}"
            self._finish_now(att, _Outcome.EXITED, -1, "start-failed", why)
            return
        if any(n in self._down for n in nodes):
            self._finish_now(att, _Outcome.EXITED, -1, "node-lost", None)
            return
        if not c.spec.command:
            self._finish_now(
                att, _Outcome.EXITED, 127, "start-failed",
                "the workload has no command to run (spec.command is empty)",
            )
            return
        from ray.util.placement_group import placement_group

        bundles = [self._bundle(a, c.spec) for a in c.placement]
        ray_nodes = [self._ray_node.get(n) for n in nodes]
        strategy = "STRICT_SPREAD" if len(set(ray_nodes)) == len(ray_nodes) > 1 else "PACK"
        att.pg_name = self._pg_name(c.workload, c.attempt)
        try:
            att.pg = placement_group(bundles, strategy=strategy, name=att.pg_name, lifetime="detached")
        except Exception as exc:
            self._finish_now(att, _Outcome.EXITED, -1, "start-failed",
                             f"placement group refused by Ray: {exc}")
            return
        att.pg_ready_ref = att.pg.ready()
        att.since = time.monotonic()

    @staticmethod
    def _bundle(a: ReplicaAlloc, spec: WorkloadSpec) -> dict[str, float]:
        bundle: dict[str, float] = {node_resource(a.node): 1.0}
        gpus = a.gpu_per_device * len(a.devices) / 1000 if a.devices else spec.resources.gpu / 1000
        if gpus:
            bundle["GPU"] = gpus
        return bundle

    def _spawn(self, att: _Attempt) -> None:
        """The placement group is ready: one actor per bundle, each starting its program."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = att.spec
        assert spec is not None
        ckpt = self.checkpoint_root / att.workload
        for rep, alloc in zip(att.replicas, att.placement, strict=True):
            gpus = self._bundle(alloc, spec).get("GPU", 0.0)
            meta = {
                "workload": att.workload,
                "attempt": att.attempt,
                "replica": rep.index,
                "replicas": len(att.replicas),
                "node": rep.node,
                "devices": list(alloc.devices),
                "gpu_milli": alloc.gpu_per_device * len(alloc.devices),
                "vram_mib": alloc.res.vram,
                "cpu_milli": alloc.res.cpu,
                "memory_mib": alloc.res.ram,
                "pg": att.pg_name,
            }
            warm = self._take_warm(rep.node)
            if warm is not None:
                # a warm actor pinned to the node: the bundle holds the resources on Ray,
                # the actor only runs the program
                rep.actor, rep.name = warm.actor, warm.name
            else:
                rep.actor = self._runner.options(
                    name=rep.name,
                    lifetime="detached",
                    num_cpus=0,
                    num_gpus=gpus,
                    resources={node_resource(rep.node): 1.0},
                    max_restarts=0,
                    max_concurrency=self.config.runner_concurrency,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        placement_group=att.pg, placement_group_bundle_index=rep.index
                    ),
                ).remote(meta)
            env = self._env(att, rep, alloc, spec, ckpt)
            log_path = str(self.log_root / att.workload / f"a{att.attempt}-r{rep.index}.log")
            rep.start_ref = rep.actor.start.remote(list(spec.command), env, None, log_path, meta)
        att.phase = _Phase.SPAWNING

    def _env(
        self, att: _Attempt, rep: _Replica, alloc: ReplicaAlloc, spec: WorkloadSpec, ckpt: Path
    ) -> dict[str, str]:
        env = dict(spec.env)
        if alloc.res.cpu and "OMP_NUM_THREADS" not in spec.env:
            env["OMP_NUM_THREADS"] = str(max(1, -(-alloc.res.cpu // 1000)))
        env.update({
            "MLWE_WORKLOAD_ID": att.workload,
            "MLWE_ATTEMPT": str(att.attempt),
            "MLWE_REPLICA": str(rep.index),
            "MLWE_REPLICAS": str(len(att.replicas)),
            "MLWE_NODE": rep.node,
            "MLWE_CHECKPOINT_DIR": str(ckpt),
            "MLWE_RESUME_WORK_S": str(float(att.resume_work_s)),
            # the devices the control plane chose on that node, not Ray's own pick
            "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in alloc.devices),
        })
        return env

    # ================================================================ stop
    def _stop(self, c: StopCommand) -> None:
        key = (c.workload, c.attempt)
        att = self._attempts.get(key)
        if att is None:
            if key in self._reported:
                return  # its end was already reported
            att = self._adopt_one(c.workload, c.attempt)
            if att is None:
                # nothing of it runs on Ray (never started here, or long gone)
                self._reported.add(key)
                self._emit(Released(c.workload, c.attempt), c.correlation_id)
                return
        if att.phase is _Phase.DONE or att.outcome is not None:
            return  # already ending (exit, node loss or an earlier stop)
        att.correlation_id = att.correlation_id or c.correlation_id
        self._begin_stop(att, c.grace_s, _Outcome.RELEASED)

    def _begin_stop(self, att: _Attempt, grace_s: float, outcome: _Outcome) -> None:
        att.outcome = outcome
        att.stop_requested = True
        att.stop_grace = max(0.0, grace_s)
        att.t_stop = time.monotonic()
        if att.phase is _Phase.PLACING:
            self._begin_teardown(att, force=True)
        elif att.phase in (_Phase.SPAWNING, _Phase.RUNNING):
            # while spawning, the programs may be starting right now: the actor serialises
            # start and stop, and a start after a stop is refused, so nothing is left behind
            self._ask_stop(att)

    def _ask_stop(self, att: _Attempt) -> None:
        for rep in att.replicas:
            if rep.actor is not None and rep.stop_ref is None and rep.died is None:
                rep.stop_ref = rep.actor.stop.remote(att.stop_grace)
        att.phase = _Phase.STOPPING
        att.since = time.monotonic()

    def _begin_teardown(self, att: _Attempt, *, force: bool, drain: bool = True) -> None:
        """Kill the actors and remove the placement group; confirmation follows in poll.

        With ``drain``, each live actor is first asked for a last sample, so the final
        reports (last progress, loss, checkpoint) are not lost with it."""
        if att.phase in (_Phase.DONE, _Phase.CONFIRMING):
            return
        if drain and att.phase in (_Phase.RUNNING, _Phase.STOPPING):
            live = [r for r in att.replicas if r.actor is not None and r.died is None]
            if live:
                for r in live:
                    # a periodic sample still pending may predate the exit: ask once more
                    r.drain_refs = [x for x in (r.sample_ref, r.actor.sample.remote()) if x]
                    r.sample_ref = None
                att.teardown_force = force
                att.phase = _Phase.DRAINING
                att.since = time.monotonic()
                return
        if force and att.phase in (
            _Phase.SPAWNING, _Phase.RUNNING, _Phase.STOPPING, _Phase.DRAINING
        ):
            att.forced = True
            # programs still running are killed with their actors (parent-death signal), and
            # a task on their node SIGKILLs their process groups in case a child escaped it
            self._reap_programs(att)
        self._kill(att)

    def _reap_programs(self, att: _Attempt) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        by_node: dict[str, list[int]] = {}
        for rep in att.replicas:
            if rep.pid and rep.node not in self._down and rep.reap_ref is None:
                done = rep.stop_result is not None and not rep.stop_result.get("survivors")
                if not done:
                    by_node.setdefault(rep.node, []).append(rep.pid)
        for node, pids in by_node.items():
            ray_node = self._ray_node.get(node)
            if ray_node is None:
                continue
            ref = self._reaper.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                resources={node_resource(node): 0.001},
            ).remote(pids)
            for rep in att.replicas:
                if rep.node == node and rep.pid in pids:
                    rep.reap_ref = ref

    def _kill(self, att: _Attempt) -> None:
        ray = _ray()
        from ray.util.placement_group import remove_placement_group

        for rep in att.replicas:
            if rep.actor is not None:
                try:
                    ray.kill(rep.actor, no_restart=True)
                except Exception as exc:  # already gone
                    log.debug("ray.kill %s: %s", rep.name, exc)
                rep.probe_ref = None
        if att.pg is not None:
            try:
                remove_placement_group(att.pg)
            except Exception as exc:
                log.debug("remove_placement_group %s: %s", att.pg_name, exc)
        att.pg_ready_ref = None
        for rep in att.replicas:
            rep.start_ref = rep.wait_ref = rep.stop_ref = None
        att.phase = _Phase.CONFIRMING
        att.since = time.monotonic()

    # ================================================================ advancing
    def _pending_refs(self) -> list[Any]:
        """Every ref whose completion moves an attempt (or the warm pool) forward."""
        refs: list[Any] = []
        for att in self._attempts.values():
            if att.phase is _Phase.DONE:
                continue
            if att.pg_ready_ref is not None:
                refs.append(att.pg_ready_ref)
            for rep in att.replicas:
                for r in (rep.start_ref, rep.wait_ref, rep.stop_ref, rep.probe_ref, rep.reap_ref):
                    if r is not None:
                        refs.append(r)
                refs.extend(rep.drain_refs)
        for warm in self._pool_entries():
            if warm.ready_ref is not None:
                refs.append(warm.ready_ref)
        return refs

    def _advance(self) -> None:
        ray = _ray()
        refs = self._pending_refs()
        ready: set[Any] = set()
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            ready = set(done)
        self._advance_pool(ready)
        for att in list(self._attempts.values()):
            try:
                self._advance_one(att, ready)
            except Exception as exc:  # one attempt's surprise must not stall the others
                self._error(f"{att.workload}#{att.attempt}: {type(exc).__name__}: {exc}")
                if att.phase is not _Phase.CONFIRMING and att.phase is not _Phase.DONE:
                    if att.outcome is None:
                        att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "error"
                    self._begin_teardown(att, force=True, drain=False)

    def _get(self, ref: Any) -> tuple[bool, Any]:
        """(True, value) or (False, the Ray error) for a ready ref."""
        ray = _ray()
        try:
            return True, ray.get(ref, timeout=0)
        except ray.exceptions.RayError as exc:
            return False, exc

    def _advance_one(self, att: _Attempt, ready: set[Any]) -> None:
        now = time.monotonic()
        if att.phase is _Phase.PLACING:
            if att.pg_ready_ref in ready:
                att.pg_ready_ref = None
                self._spawn(att)
            elif now - att.since > self.config.start_timeout_s:
                att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "start-failed"
                self._error(
                    f"{att.workload}#{att.attempt}: Ray did not reserve its placement group"
                    f" in {self.config.start_timeout_s:g}s (is something else holding the GPUs?)"
                )
                self._begin_teardown(att, force=True)
            return
        if att.phase is _Phase.SPAWNING:
            self._advance_spawning(att, ready, now)
            return
        if att.phase is _Phase.RUNNING:
            self._advance_running(att, ready)
            return
        if att.phase is _Phase.STOPPING:
            self._advance_stopping(att, ready, now)
            return
        if att.phase is _Phase.DRAINING:
            self._advance_draining(att, ready, now)
            return
        if att.phase is _Phase.CONFIRMING:
            self._advance_confirming(att, ready, now)

    def _advance_draining(self, att: _Attempt, ready: set[Any], now: float) -> None:
        # a replica whose node died will never answer: its last sample is not waited for
        pending = [ref for r in att.replicas if r.node not in self._down for ref in r.drain_refs]
        if any(ref not in ready for ref in pending) and now - att.since < self.config.drain_timeout_s:
            return
        for r in att.replicas:
            for ref in r.drain_refs:  # in the order asked: the last one saw the end
                if ref in ready:
                    ok, value = self._get(ref)
                    if ok:
                        self._take_sample(att, r, value, self.clock.now())
                    else:
                        log.warning("%s#%s replica %s: last sample failed: %s",
                                    att.workload, att.attempt, r.index, value)
                elif r.node in self._down:
                    log.warning("%s#%s replica %s: its node died before its last sample",
                                att.workload, att.attempt, r.index)
                else:
                    log.warning("%s#%s replica %s: no last sample within %gs; its final"
                                " reports are lost", att.workload, att.attempt, r.index,
                                self.config.drain_timeout_s)
            r.drain_refs = []
        self._begin_teardown(att, force=att.teardown_force, drain=False)

    def _advance_spawning(self, att: _Attempt, ready: set[Any], now: float) -> None:
        for rep in att.replicas:
            if rep.start_ref is not None and rep.start_ref in ready:
                ok, value = self._get(rep.start_ref)
                rep.start_ref = None
                if not ok:
                    rep.died = str(value)
                    if att.outcome is None:
                        att.outcome, att.exit_code = _Outcome.EXITED, -1
                        att.cause = "start-failed"
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index}: {value}")
                elif not value.get("ok"):
                    if att.outcome is None:
                        att.outcome = _Outcome.EXITED
                        att.exit_code = int(value.get("exit_code", 127))
                        att.cause = "start-failed"
                        att.error = str(value.get("error"))
                        self._error(f"{att.workload}#{att.attempt}: {att.error}")
                else:
                    rep.pid = int(value["pid"])
                    rep.ray_node_id = value.get("ray_node_id")
                    rep.actor_pid = value.get("actor_pid")
                    expected = self._ray_node.get(rep.node)
                    if rep.ray_node_id and expected and rep.ray_node_id != expected:
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index} runs on Ray"
                                    f" node {rep.ray_node_id[:12]}, not {rep.node}'s {expected[:12]}")
        if any(rep.start_ref is not None for rep in att.replicas):
            if now - att.since > self.config.start_timeout_s and att.outcome is None:
                att.outcome, att.exit_code, att.cause = _Outcome.EXITED, -1, "start-failed"
                self._error(f"{att.workload}#{att.attempt}: actors did not start in"
                            f" {self.config.start_timeout_s:g}s")
                self._begin_teardown(att, force=True)
            return
        if att.outcome is _Outcome.EXITED:  # a replica could not start: the gang does not run
            self._begin_teardown(att, force=True)
            return
        for rep in att.replicas:
            rep.wait_ref = rep.actor.wait.remote()
        att.phase = _Phase.RUNNING
        att.since = time.monotonic()
        att.started_s = att.since - att.t_start
        self._emit(Started(att.workload, att.attempt), att.correlation_id)

    def _advance_running(self, att: _Attempt, ready: set[Any]) -> None:
        for rep in att.replicas:
            if rep.wait_ref is not None and rep.wait_ref in ready:
                ok, value = self._get(rep.wait_ref)
                rep.wait_ref = None
                if ok:
                    rep.exit_code, rep.killed_by = _exit_of(value)
                else:
                    rep.died = str(value)
        # Settle node loss before blaming the workload. When a node dies its actors are
        # reported dead, and its programs killed (their parent-death signal), at once;
        # the GCS says the node died seconds later (more on a loaded machine). An actor
        # death, or a program killed by a signal, on a node not yet known dead is the
        # workload's only once the node is shown alive (its raylet answers) or a settle
        # time has passed without the node dying.
        died = [r for r in att.replicas if r.died is not None]
        killed = [r for r in att.replicas if r.exit_code not in (None, 0) and r.killed_by]
        for rep in (*died, *killed):
            if rep.node in self._down or not self._node_alive(rep.node):
                return  # the node watcher turns this into NodeDown and tears the attempt down
            if not rep.raylet_answered:
                gone = self._raylet_gone(rep.node, rep.ray_node_id)
                if gone:
                    return  # its node died, the GCS has not noticed yet: node-lost, not an error
                rep.raylet_answered = gone is False
            if rep.died_at is None:
                rep.died_at = time.monotonic()
        if died:
            rep = died[0]
            # an actor on a dying node can be reported dead before its node is: give the node
            # watcher time to tell (longer when Ray's message itself blames the node)
            text = (rep.died or "").lower()
            blames_node = "node" in text and ("died" in text or "dead" in text)
            settle = NODE_DEATH_SETTLE_S if blames_node else self.config.actor_death_settle_s
            assert rep.died_at is not None
            if time.monotonic() - rep.died_at < settle:
                return
            att.outcome, att.exit_code = _Outcome.EXITED, -1
            att.cause = "oom" if "memory" in (rep.died or "").lower() else "error"
            self._error(f"{att.workload}#{att.attempt} replica {rep.index}: actor died: {rep.died}")
            self._begin_teardown(att, force=True)
            return
        if any(not r.raylet_answered and r.died_at is not None
               and time.monotonic() - r.died_at < self.config.actor_death_settle_s for r in killed):
            return  # killed by a signal, node not yet shown alive: wait for the node watcher
        failed = [r for r in att.replicas if r.exit_code not in (None, 0)]
        if failed:
            first = failed[0]
            att.outcome, att.exit_code = _Outcome.EXITED, first.exit_code or 1
            att.cause = f"killed by {first.killed_by}" if first.killed_by else "error"
            # a gang with a failed member is broken: the rest are stopped at once
            self._begin_teardown(att, force=True)
            return
        if all(r.exit_code == 0 for r in att.replicas):
            att.outcome, att.exit_code, att.cause = _Outcome.EXITED, 0, ""
            self._begin_teardown(att, force=False)

    def _advance_stopping(self, att: _Attempt, ready: set[Any], now: float) -> None:
        for rep in att.replicas:
            if rep.start_ref is not None and rep.start_ref in ready:
                ok, value = self._get(rep.start_ref)
                rep.start_ref = None
                if ok and value.get("ok"):
                    rep.pid = int(value["pid"])
            if rep.stop_ref is not None and rep.stop_ref in ready:
                ok, value = self._get(rep.stop_ref)
                rep.stop_ref = None
                if ok:
                    rep.stop_result = value
                    if rep.index == 0 and value.get("checkpoint_progress") is not None:
                        att.checkpoint_progress = float(value["checkpoint_progress"])
                    if value.get("forced"):
                        att.forced = True
                    if value.get("survivors"):
                        self._error(f"{att.workload}#{att.attempt} replica {rep.index}: processes"
                                    f" {value['survivors']} survived SIGKILL")
                else:
                    rep.died = str(value)
            # a program that ended by itself while we waited is fine: it is gone either way
            if rep.wait_ref is not None and rep.wait_ref in ready:
                ok, value = self._get(rep.wait_ref)
                rep.wait_ref = None
                if ok:
                    rep.exit_code, rep.killed_by = _exit_of(value)
        pending = [r for r in att.replicas if r.stop_ref is not None]
        if not pending:
            survivors = any((r.stop_result or {}).get("survivors") for r in att.replicas)
            self._begin_teardown(att, force=survivors)
            return
        if now - att.since > att.stop_grace + self.config.stop_margin_s:
            self._error(f"{att.workload}#{att.attempt}: actors did not answer the stop within"
                        f" {att.stop_grace + self.config.stop_margin_s:g}s: killing them")
            for r in pending:
                r.stop_ref = None
            self._begin_teardown(att, force=True, drain=False)

    def _advance_confirming(self, att: _Attempt, ready: set[Any], now: float) -> None:
        ray = _ray()
        from ray.util.placement_group import placement_group_table

        all_dead = True
        for rep in att.replicas:
            if rep.reap_ref is not None:
                if rep.reap_ref in ready:
                    ok, value = self._get(rep.reap_ref)
                    if ok and value:
                        self._error(f"{att.workload}#{att.attempt}: pids {value} survived the reaper")
                    rep.reap_ref = None
                elif rep.node in self._down:
                    rep.reap_ref = None  # the node is gone, and its processes with it
                else:
                    all_dead = False
            if rep.actor is None or rep.dead:
                continue
            if rep.probe_ref is None:
                rep.probe_ref = rep.actor.info.remote()
                all_dead = False
                continue
            if rep.probe_ref not in ready:
                all_dead = False
                continue
            ok, value = self._get(rep.probe_ref)
            rep.probe_ref = None
            if not ok and isinstance(value, ray.exceptions.RayActorError) and not isinstance(
                value, ray.exceptions.ActorUnavailableError
            ):
                rep.dead = True
            else:
                all_dead = False  # the kill has not landed yet: probe again next poll
        if all_dead and att.pg is not None:
            state = (placement_group_table(att.pg) or {}).get("state")
            if state != "REMOVED":
                all_dead = False
        if all_dead and self._use_state_api():
            all_dead = self._state_api_confirms_dead(att)
        if not all_dead:
            if now - att.since > self.config.confirm_timeout_s:
                self._error(f"{att.workload}#{att.attempt}: Ray did not confirm its actors gone in"
                            f" {self.config.confirm_timeout_s:g}s; reporting it anyway")
            else:
                return
        self._finish(att)

    def _state_api_confirms_dead(self, att: _Attempt) -> bool:
        try:
            from ray.util.state import get_actor

            for rep in att.replicas:
                if rep.actor is None:
                    continue
                info = get_actor(rep.actor._actor_id.hex(), address=self._api_url, timeout=5)
                if info is not None and info.state != "DEAD":
                    return False
            return True
        except Exception as exc:
            log.debug("state API unavailable: %s", exc)
            self._state_api = False
            return True  # the refs already confirmed it; the state API is a second witness

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

    def _node_alive(self, node: str) -> bool:
        self._check_nodes()
        return node not in self._down

    def _raylet_gone(self, node: str, ray_node_id: str | None) -> bool | None:
        """Settle an actor death before blaming the workload: did its node die with it?

        The GCS marks a Ray node dead only after several missed health checks
        (seconds; longer on a loaded machine), while the actors of a killed node
        are reported dead at once. A dead raylet's port refuses connections the
        moment its process is gone, so a refused connection is a direct witness
        of the node's death: the node is lost (NodeDown), and the attempt ends as
        node-lost, not as the workload's error. True: gone (and reported so);
        False: the raylet answers, the node lives; None: no proof either way (a
        timeout, no address), the caller keeps its settle time.
        """
        if node in self._down:
            return True
        rid = ray_node_id or self._ray_node.get(node)
        if rid is None:
            return None
        addr = None
        try:
            for n in _ray().nodes():
                if str(n.get("NodeID")) == rid:
                    addr = (str(n["NodeManagerAddress"]), int(n["NodeManagerPort"]))
                    break
        except Exception as exc:  # the GCS itself is unreachable: no witness
            log.debug("node table unavailable: %s", exc)
            return None
        if addr is None:
            return None
        try:
            with socket.create_connection(addr, timeout=2.0):
                return False  # the raylet answers: the node is alive
        except ConnectionRefusedError:
            pass
        except OSError:
            return None  # unreachable or slow: not proof either way
        self._dead_ray_nodes.add(rid)
        self._node_lost(node, f"Ray node {rid[:12]} died (its raylet at {addr[0]}:{addr[1]} refuses"
                              " connections; its actors died with it)")
        return True

    # ================================================================ finishing
    def _finish(self, att: _Attempt) -> None:
        att.phase = _Phase.DONE
        self._attempts.pop(att.key, None)
        self._reported.add(att.key)
        self._finished[att.key] = self._summary(att)
        while len(self._finished) > 1000:
            self._finished.popitem(last=False)
        if att.outcome is _Outcome.RELEASED:
            frac = att.checkpoint_progress
            self._emit(Released(att.workload, att.attempt, checkpointed_progress=frac),
                       att.correlation_id)
            if att.t_stop is not None:
                self.stop_figures.append({
                    "signal_to_released_s": time.monotonic() - att.t_stop,
                    "grace_s": att.stop_grace,
                    "forced": float(att.forced),
                })
                del self.stop_figures[:-1000]
        elif att.outcome is _Outcome.EXITED:
            cause = att.cause
            if cause == "start-failed" and att.error:
                cause = f"start-failed: {att.error}"
            self._emit(Exited(att.workload, att.attempt, att.exit_code, cause), att.correlation_id)

    def _finish_now(
        self, att: _Attempt, outcome: _Outcome, code: int, cause: str, error: str | None
    ) -> None:
        """End an attempt that never reached Ray (nothing to tear down)."""
        att.outcome, att.exit_code, att.cause, att.error = outcome, code, cause, error
        if error:
            self._error(f"{att.workload}#{att.attempt}: {error}")
        self._finish(att)

    # ================================================================ telemetry
    def _sample(self) -> None:
        """Collect the replica samples asked for last period, ask for the next ones, and add
        a sample per node (aggregates of its replicas, and what Ray says of it)."""
        ray = _ray()
        now = self.clock.now()
        running = [a for a in self._attempts.values() if a.phase is _Phase.RUNNING]
        refs = [r.sample_ref for a in running for r in a.replicas if r.sample_ref is not None]
        ready: set[Any] = set()
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
            ready = set(done)
        per_node: dict[str, dict[str, float]] = {
            n: {"cpu_pct": 0.0, "rss_mib": 0.0, "workloads": 0.0, "gpus_allocated": 0.0,
                "vram_allocated_mib": 0.0}
            for n in self.node_specs
        }
        for att in running:
            for rep in att.replicas:
                agg = per_node.get(rep.node)
                alloc = att.placement[rep.index] if rep.index < len(att.placement) else None
                if agg is not None:
                    agg["workloads"] += 1
                    if alloc is not None:
                        agg["gpus_allocated"] += alloc.gpu_per_device * len(alloc.devices) / 1000
                        agg["vram_allocated_mib"] += alloc.res.vram
                if rep.sample_ref is not None and rep.sample_ref in ready:
                    ok, value = self._get(rep.sample_ref)
                    rep.sample_ref = None
                    if ok:
                        metrics = self._take_sample(att, rep, value, now)
                        if agg is not None:
                            agg["cpu_pct"] += metrics.get("cpu_pct", 0.0)
                            agg["rss_mib"] += metrics.get("rss_mib", 0.0)
                if rep.sample_ref is None and rep.actor is not None:
                    rep.sample_ref = rep.actor.sample.remote()
        alive_actors = self._actors_per_node() if self._use_state_api() else None
        for name, spec in self.node_specs.items():
            agg = per_node[name]
            metrics = {k: round(v, 2) for k, v in agg.items()}
            metrics["cpu_util"] = round(agg["cpu_pct"] / 100 / max(spec.cpu / 1000, 1e-9), 4)
            metrics["ray_alive"] = 0.0 if name in self._down else 1.0
            if agg["workloads"]:
                # the machine, as measured by an actor running there (none runs: none measured)
                metrics.update(self._host.get(name, {}))
            rn = self._ray_node.get(name)
            if alive_actors is not None and rn is not None:
                metrics["ray_actors_alive"] = float(alive_actors.get(rn, 0))
            declared: tuple[str, ...] = ()
            if spec.gpus:
                # no NVML reading here: the GPU figures are what the control plane allocated
                metrics["vram_used_mib"] = agg["vram_allocated_mib"]
                declared = ("gpus_allocated", "vram_allocated_mib", "vram_used_mib")
            self._telemetry.append(Telemetry(now, name, None, metrics, declared))

    def _actors_per_node(self) -> dict[str, int] | None:
        try:
            from ray.util.state import list_actors

            out: dict[str, int] = {}
            for a in list_actors(address=self._api_url, filters=[("state", "=", "ALIVE")],
                                 limit=10_000, timeout=5):
                if a.node_id:
                    out[a.node_id] = out.get(a.node_id, 0) + 1
            return out
        except Exception as exc:
            log.debug("state API list_actors failed: %s", exc)
            return None

    def _take_sample(
        self, att: _Attempt, rep: _Replica, value: dict[str, Any], now: float
    ) -> dict[str, float]:
        """One replica's sample: telemetry, and (first replica) progress facts."""
        metrics: dict[str, float] = {
            k: float(v) for k, v in (value.get("metrics") or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        alloc = att.placement[rep.index] if rep.index < len(att.placement) else None
        declared: tuple[str, ...] = ()
        if alloc is not None and alloc.devices:
            metrics["gpus"] = alloc.gpu_per_device * len(alloc.devices) / 1000
            if value.get("gpu_measured"):
                declared = ("gpus",)  # the allocation; utilisation, power, VRAM are NVML's
            else:
                # no GPU to read on that node: the figures are the allocation, labelled so
                metrics["vram_used_mib"] = float(alloc.res.vram)
                declared = ("gpus", "vram_used_mib")
        host = value.get("host")
        if isinstance(host, dict):
            self._host[rep.node] = {
                k: float(v) for k, v in host.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
        metrics["replica"] = float(rep.index)
        metrics["attempt"] = float(att.attempt)
        self._telemetry.append(Telemetry(now, rep.node, att.workload, metrics, declared))
        # progress is the first replica's (rank 0) to tell, and only while it runs: once a
        # stop is asked, what was saved travels in Released
        if rep.index != 0:
            return metrics
        for msg in value.get("reports") or ():
            p = msg.get("progress")
            if msg.get("checkpoint") and isinstance(p, int | float) and 0.0 <= p <= 1.0:
                att.checkpoint_progress = float(p)
                if not att.stop_requested:
                    att.progress_sent = float(p)
                    self._emit(Progress(att.workload, att.attempt, float(p), checkpointed=True),
                               att.correlation_id)
        if not att.stop_requested:
            p = value.get("progress")
            if isinstance(p, int | float) and 0.0 <= p <= 1.0 and (
                p - att.progress_sent >= self.config.progress_step
                or (p >= 1.0 > att.progress_sent)
            ):
                att.progress_sent = float(p)
                self._emit(Progress(att.workload, att.attempt, float(p)), att.correlation_id)
        return metrics

    # ================================================================ watcher
    def _watch(self) -> None:
        """Give the watcher the refs still pending after this poll (those already ready
        but not consumed are left out, or it would wake the engine over and over)."""
        ray = _ray()
        refs = self._pending_refs()
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=False)
            ready = set(done)
            refs = [r for r in refs if r not in ready]
        self._watch_refs = refs  # one assignment: the watcher reads either list whole
        self._watch_fresh.set()
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch_loop, name="mlwe-ray-watch",
                                             daemon=True)
            self._watcher.start()

    def _watch_loop(self) -> None:
        ray = _ray()
        while not self._closed:
            if not self._watch_fresh.wait(0.5):
                continue
            self._watch_fresh.clear()
            refs = self._watch_refs
            if not refs:
                continue
            try:
                done, _ = ray.wait(refs, num_returns=1, timeout=0.5, fetch_local=False)
            except Exception as exc:  # Ray shutting down
                log.debug("watcher: %s", exc)
                return
            if not done:
                self._watch_fresh.set()  # nothing yet: look again (the list may be newer)
                continue
            for listener in list(self.event_listeners):
                listener()  # the engine polls, which hands over fresh refs

    # ================================================================ warm pool
    def _pool_entries(self) -> list[_Warm]:
        return [w for entries in self._pool.values() for w in entries]

    def _refill_pool(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        want = self.config.warm_runners_per_node
        if not want or self._closed:
            return
        for node, ray_node in self._ray_node.items():
            if node in self._down:
                continue
            entries = self._pool.setdefault(node, [])
            while len(entries) < want:
                name = f"{self.config.prefix}:{POOL_TAG}:{node}:{next(self._pool_seq)}"
                actor = self._runner.options(
                    name=name,
                    lifetime="detached",
                    num_cpus=0,
                    max_restarts=0,
                    max_concurrency=self.config.runner_concurrency,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                ).remote({"node": node, "warm": True})
                entries.append(_Warm(node, name, actor, actor.info.remote()))

    def _advance_pool(self, ready: set[Any]) -> None:
        for entries in self._pool.values():
            for warm in list(entries):
                if warm.ready_ref is None or warm.ready_ref not in ready:
                    continue
                ok, value = self._get(warm.ready_ref)
                warm.ready_ref = None
                if ok:
                    warm.ready = True
                else:  # it could not start (its node is going?): forget it, refill later
                    log.debug("warm runner %s failed: %s", warm.name, value)
                    entries.remove(warm)
                    self._kill_quietly(warm.actor)

    def _take_warm(self, node: str) -> _Warm | None:
        entries = self._pool.get(node, [])
        for warm in entries:
            if warm.ready:
                entries.remove(warm)
                return warm
        return None

    def _kill_quietly(self, actor: Any) -> None:
        try:
            _ray().kill(actor, no_restart=True)
        except Exception as exc:
            log.debug("ray.kill: %s", exc)

    def _drain_pool(self) -> None:
        """Kill every warm actor and wait (a little) until Ray confirms them gone."""
        ray = _ray()
        warm = self._pool_entries()
        self._pool.clear()
        for w in warm:
            self._kill_quietly(w.actor)
        deadline = time.monotonic() + 10.0
        pending = list(warm)
        while pending and time.monotonic() < deadline:
            refs = {w.actor.info.remote(): w for w in pending}
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=1.0)
            for ref in done:
                ok, value = self._get(ref)
                if not ok and isinstance(value, ray.exceptions.RayActorError) and not isinstance(
                    value, ray.exceptions.ActorUnavailableError
                ):
                    pending.remove(refs[ref])
            if pending:
                time.sleep(0.05)

    # ================================================================ adoption
    def _named_actors(self) -> dict[tuple[str, int], dict[int, str]]:
        """Actors of this prefix on Ray: (workload, attempt) -> {replica: name}.

        A warm actor's name does not say what it runs: it is asked (and one that
        runs nothing and is not in this backend's pool, an earlier engine's, is killed)."""
        ray = _ray()
        out: dict[tuple[str, int], dict[int, str]] = {}
        ns = ray.get_runtime_context().namespace
        mine = {w.name for w in self._pool_entries()} | {
            r.name for a in self._attempts.values() for r in a.replicas
        }
        for entry in ray.util.list_named_actors(all_namespaces=True):
            name = entry["name"] if isinstance(entry, dict) else entry
            if isinstance(entry, dict) and entry.get("namespace") != ns:
                continue
            parts = name.split(":")
            if len(parts) != 4 or parts[0] != self.config.prefix:
                continue
            if parts[1] == POOL_TAG:
                if name in mine:
                    continue
                try:
                    actor = ray.get_actor(name)
                    info = ray.get(actor.info.remote(), timeout=30)
                except Exception as exc:
                    log.debug("warm actor %s: %s", name, exc)
                    continue
                if info.get("workload") is None:
                    self._kill_quietly(actor)  # idle, left by an earlier engine
                    continue
                out.setdefault((str(info["workload"]), int(info["attempt"])), {})[
                    int(info.get("replica", 0))] = name
                continue
            try:
                attempt, replica = int(parts[2]), int(parts[3])
            except ValueError:
                continue
            out.setdefault((parts[1], attempt), {})[replica] = name
        return out

    def _adopt(self) -> None:
        for key in self._named_actors():
            if key not in self._attempts and key not in self._reported:
                self._adopt_one(*key)
        self._remove_stray_groups()

    def _adopt_one(self, workload: str, attempt: int) -> _Attempt | None:
        """Rebuild the tracking of an attempt started by an earlier engine, from Ray."""
        ray = _ray()
        names = self._named_actors().get((workload, attempt))
        if not names:
            return None
        replicas: list[_Replica] = []
        nodes: list[str] = []
        for idx in sorted(names):
            try:
                actor = ray.get_actor(names[idx])
                info = ray.get(actor.info.remote(), timeout=30)
            except Exception as exc:
                self._error(f"cannot adopt {names[idx]}: {exc}")
                continue
            rep = _Replica(idx, str(info["node"]), names[idx], actor=actor, pid=info.get("pid"))
            if info.get("pid") is None:
                rep.died = info.get("start_error") or "never started"
            replicas.append(rep)
            nodes.append(rep.node)
        if not replicas:
            return None
        from ray.util.placement_group import get_placement_group

        pg_name = self._pg_name(workload, attempt)
        try:
            pg = get_placement_group(pg_name)
        except ValueError:
            pg = None
        att = _Attempt(workload, attempt, tuple(nodes), replicas, None, (), None,
                       phase=_Phase.RUNNING, pg=pg, pg_name=pg_name, adopted=True)
        att.progress_sent = 0.0
        for rep in replicas:
            if rep.died is None:
                rep.wait_ref = rep.actor.wait.remote()
        self._attempts[att.key] = att
        return att

    def _remove_stray_groups(self) -> None:
        """Placement groups of this prefix with no actor (a start cut short by a crash)."""
        from ray._raylet import PlacementGroupID
        from ray.util.placement_group import PlacementGroup, placement_group_table

        live_pgs = {a.pg_name for a in self._attempts.values()}
        for pg_id, entry in placement_group_table().items():
            name = entry.get("name") or ""
            if not name.startswith(f"{self.config.prefix}:") or entry.get("state") == "REMOVED":
                continue
            if name in live_pgs:
                continue
            from ray.util.placement_group import remove_placement_group

            try:
                remove_placement_group(PlacementGroup(PlacementGroupID(bytes.fromhex(pg_id))))
            except Exception as exc:
                log.debug("could not remove stray placement group %s: %s", name, exc)


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


def _exit_of(value: Any) -> tuple[int, str | None]:
    """The runner's ``wait`` answer as (exit code, signal name or None)."""
    if isinstance(value, dict):
        sig = value.get("signal")
        return int(value.get("code", -1)), str(sig) if sig else None
    return int(value), None


def _reap_groups(pids: list[int]) -> list[int]:
    """Runs as a Ray task on the node: SIGKILL the programs' process groups, wait until gone."""
    return kill_groups(pids)


def ray_backend_factory(
    cluster: ClusterSpec, config: RayBackendConfig | None = None
) -> Callable[[Clock], RayBackend]:
    """A factory for ``Engine.open(backend=...)``: builds the backend with the engine's clock."""

    def make(clock: Clock) -> RayBackend:
        return RayBackend(cluster, config, clock=clock)

    return make


__all__ = ["RayBackend", "RayBackendConfig", "ray_backend_factory"]

