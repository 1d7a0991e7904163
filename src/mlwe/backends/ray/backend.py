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

The parts live in modules of their own, stacked into :class:`RayBackend`:
:mod:`.config` (the options), :mod:`.state` (the bookkeeping), :mod:`.pool`
(warm runners), :mod:`.adoption`, :mod:`.telemetry`, :mod:`.teardown`
(stopping and confirming), :mod:`.nodes` (node loss) and :mod:`.lifecycle`
(starting and advancing); this module holds the protocol and the watcher.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from mlwe.backends.common import WallClock
from mlwe.backends.ray.cluster import LocalRayCluster, check_reachable
from mlwe.backends.ray.config import RayBackendConfig
from mlwe.backends.ray.lifecycle import _Lifecycle
from mlwe.backends.ray.runner import ReplicaRunner
from mlwe.backends.ray.state import _api_server_url, _Attempt, _Outcome, _Phase, _ray, _Warm, log
from mlwe.backends.ray.teardown import _reap_groups
from mlwe.core.backend import Command, Event, RunningAttempt, Telemetry, dispatch
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec, NodeSpec


class RayBackend(_Lifecycle):
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
        self.clock: Clock = clock or WallClock()
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


def ray_backend_factory(
    cluster: ClusterSpec, config: RayBackendConfig | None = None
) -> Callable[[Clock], RayBackend]:
    """A factory for ``Engine.open(backend=...)``: builds the backend with the engine's clock."""

    def make(clock: Clock) -> RayBackend:
        return RayBackend(cluster, config, clock=clock)

    return make


__all__ = ["RayBackend", "RayBackendConfig", "ray_backend_factory"]
