"""One running engine: control plane + scheduler + reconciler + backend + store + audit + streams.

The engine owns the loop the DESIGN's data path describes (convention 1: the
core decides, the runtime carries it out):

    tick: 1. apply (queued calls, backend events as facts deduplicated by id)
          2. commands (a reconciler step: the effects of what was applied, read
             as a value, plus a scheduling cycle)
          1'. apply the tick hooks' proposals (agent, workflows), which read
             the state that step settled
          2'. commands again, when what the hooks applied is worth a cycle
          3. flush (state, decisions, audit: one transaction)
          4. send the commands, publish the streams

The reconciler steps twice because the hooks must see the scheduling cycle's
result: they act where the scheduler did not (a reschedule workflow places its
preemptor itself only if the cycle has not; the agent's triggers look at what
is still queued after it), and what they propose takes effect in the same
tick. It is the order of the simulator (:mod:`mlwe.sim.driver`: settle, the
hooks, one more step), on which the agent's forecasts play its plans.

Requests (submit, cancel, cordon, proposals from the agent) go through the
same control plane under the engine lock, and are **acknowledged only once
durable**: ``submit`` returns after the flush that covers it. Concurrent
requests share flushes (group commit), so many small submissions cost few
disk syncs. The doors for each kind of request (``submit``, ``cancel``,
``drain``, ``propose``, ``ingest``...) are :class:`~mlwe.runtime.doors.RequestDoors`,
which the engine inherits; all of them go through :meth:`Engine.request`.

On start (:meth:`Engine.open`, step by step in :mod:`mlwe.runtime.opening`) the
engine rebuilds the control plane from the store and reconciles it with what the
backend says is running (:meth:`Engine.reconcile_backend`): attempts it still
runs are adopted, attempts it no longer has are requeued ("vanished", not the
workload's fault), attempts it runs that the engine does not know are stopped
(orphans), and starts that were owed are sent again (idempotent by request id).

Every operator action, agent proposal (accepted or rejected, with reasons) and
configuration change is an audit record written in the same transaction as its
effect; scheduling decisions too. The correlation id of a request follows it
into decisions, backend commands, audit records and stream events.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlwe.core.actions import Submit
from mlwe.core.backend import Backend, Command
from mlwe.core.catalog import DEFAULT_CATALOG, GpuCatalog
from mlwe.core.clock import Clock
from mlwe.core.controlplane import ApplyResult, ControlPlane, InvariantViolation, Rejection
from mlwe.core.decisions import DecisionRecord
from mlwe.core.reads import ClusterReads
from mlwe.core.reconcile import Reconciler, correlation_of
from mlwe.core.scheduler import Scheduler, default_scheduler
from mlwe.core.spec import ClusterSpec, WorkloadSpec
from mlwe.runtime.commit import GroupCommit
from mlwe.runtime.doors import RequestDoors, RequestRejected
from mlwe.runtime.opening import BackendFactory, open_engine
from mlwe.runtime.requests import Request, StoreRefused, audit_payload, inadmissible, screen
from mlwe.runtime.restart import RestartReport, repair
from mlwe.runtime.streams import StreamHub, audit_event, command_event, transition_event
from mlwe.runtime.telemetry import TelemetryPolicy, TelemetrySink
from mlwe.store import db
from mlwe.store.audit import AuditLog
from mlwe.store.recovery import Quarantined, StoreWriter
from mlwe.store.repository import Repository

if TYPE_CHECKING:  # the workflows are wired in by mlwe.runtime.wiring, an outer module
    from mlwe.agent.workflows import WorkflowRunner

__all__ = [
    "BackendFactory",
    "Engine",
    "EngineConfig",
    "RequestRejected",
    "StoreRefused",
    "TickReport",
    "new_correlation_id",
]

log = logging.getLogger("mlwe.engine")


@dataclass
class EngineConfig:
    grace_s: float = 10.0  # checkpoint grace period on eviction
    retry_base_s: float = 5.0
    retry_max_s: float = 600.0
    tick_s: float = 0.25  # loop period when nothing wakes it earlier
    # submissions arriving within this window share one scheduling cycle (a burst of
    # them then costs one cycle over the queue, not one each); the acknowledgement does
    # not wait for it, and backend events, operator actions and stop still wake the loop
    # at once. 0: a cycle per submission.
    admit_batch_s: float = 0.05
    telemetry_store_every_s: float = 5.0  # at most one stored sample per node/workload per this
    telemetry_downsample_after_s: float = 3600.0
    telemetry_downsample_to_s: int = 60
    telemetry_retention_s: float = 7 * 86400.0
    maintenance_every_s: float = 60.0
    recent_decisions: int = 5000


@dataclass
class TickReport:
    events: int = 0
    commands: int = 0
    telemetry: int = 0
    version: int = 0
    errors: list[str] = field(default_factory=list)


def new_correlation_id() -> str:
    return f"req-{uuid.uuid4().hex[:16]}"


class Engine(RequestDoors):
    """A control plane driving a backend, durable and audited (see the module docstring)."""

    def __init__(
        self,
        cp: ControlPlane,
        backend: Backend,
        repo: Repository,
        *,
        clock: Clock,
        scheduler: Scheduler | None = None,
        config: EngineConfig | None = None,
        streams: StreamHub | None = None,
        audit: AuditLog | None = None,
        synced: bool = True,
    ) -> None:
        self.cp = cp
        self.backend = backend
        self.repo = repo
        self.clock = clock
        self.config = config or EngineConfig()
        self.scheduler = scheduler or default_scheduler()
        if self.scheduler.estimator is not None:
            # learn from the recovered history now, and let each submission record its
            # own prediction from here on: the first cycle then pays for neither
            self.scheduler.estimator.attach(cp)
        self.streams = streams or StreamHub(clock=clock.now)
        self.audit = audit or AuditLog(repo.engine, clock=clock.now)
        self.lock = threading.RLock()
        self.reconciler = Reconciler(
            cp,
            self.scheduler,
            grace_s=self.config.grace_s,
            retry_base_s=self.config.retry_base_s,
            retry_max_s=self.config.retry_max_s,
        )
        self.writer = StoreWriter(repo, self.audit, correlate=self._decision_correlation)
        self.writer.attach(cp, sync=not synced)
        self.recent_decisions: deque[DecisionRecord] = deque(maxlen=self.config.recent_decisions)
        self._decisions_noted = 0
        cp.decision_listeners.append(self._note_decision)
        #: Called each tick, under the lock, after the scheduling cycle (agent, workflows...).
        self.tick_hooks: list[Callable[[Engine], None]] = []
        cfg = self.config
        self.telemetry = TelemetrySink(repo, self.streams, TelemetryPolicy(
            cfg.telemetry_store_every_s, cfg.telemetry_downsample_after_s,
            cfg.telemetry_downsample_to_s, cfg.telemetry_retention_s))
        #: Called with each telemetry sample (the agent's monitor).
        self.telemetry_listeners = self.telemetry.listeners
        #: The engine's workflows, once :func:`mlwe.runtime.wiring.attach_workflows` ran.
        self.workflows: WorkflowRunner | None = None
        self._calls: deque[Callable[[], None]] = deque()
        self.commits = GroupCommit(self._durably)  # concurrent requests, one flush
        self._flush_mutex = self.commits.mutex  # held by the caller committing a group
        #: commands of a tick whose flush failed: sent after the next one that succeeds
        self._held_commands: list[Command] = []
        self._last_maintenance = clock.now()
        self._wake = threading.Event()  # a tick is wanted
        self._wake_now = threading.Event()  # ... at once (not only by submissions)
        wakers = getattr(backend, "event_listeners", None)
        if isinstance(wakers, list):  # a backend that can say "events are ready": react at once
            wakers.append(self.wake)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.ticks = 0
        self.degraded: str | None = None  # why the store is not writable right now
        self.started_at = clock.now()
        self.last_restart: RestartReport | None = None
        #: records recovery could not load on this start (moved to the quarantine table)
        self.quarantined: list[Quarantined] = []

    # ============================================================ construction
    @classmethod
    def open(
        cls,
        cluster: ClusterSpec | None = None,
        backend: Backend | BackendFactory | None = None,
        *,
        data_dir: str | Path | None = None,
        database_url: str | None = None,
        clock: Clock | None = None,
        catalog: GpuCatalog = DEFAULT_CATALOG,
        config: EngineConfig | None = None,
        scheduler: Scheduler | None = None,
        create_schema: bool = True,
    ) -> Engine:
        """The engine for a data directory / database: recovered if it holds state.

        A fresh database gets the schema (``create_schema``); a database at an
        older or unknown revision is refused with the migration to run
        (:class:`mlwe.store.db.SchemaError`). Without stored nodes, ``cluster``
        seeds the state. ``backend`` is a Backend or a factory taking the clock.
        How, step by step: :mod:`mlwe.runtime.opening`.
        """
        return open_engine(cls, cluster, backend, data_dir=data_dir, database_url=database_url,
                           clock=clock, catalog=catalog, config=config, scheduler=scheduler,
                           create_schema=create_schema)

    # ================================================================= helpers
    def _decision_correlation(self, d: DecisionRecord) -> str | None:
        w = self.cp.workloads.get(d.workload)
        cid = correlation_of(w) if w is not None else None
        return cid or d.cause_id

    def now(self) -> float:
        return self.clock.now()

    def wake(self, *, soon: bool = False) -> None:
        """Ask the loop for a tick now; ``soon``: within ``config.admit_batch_s`` (what a
        submission asks, so that a burst of them shares one scheduling cycle)."""
        if not soon:
            self._wake_now.set()
        self._wake.set()

    def call_soon(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` on the engine thread at the next tick (backend access is single-threaded)."""
        self._calls.append(fn)
        self.wake()

    # ============================================================== durability
    def _flush_locked(self, extra: Callable[[Any], None] | None = None) -> None:
        try:
            self.writer.flush(extra)
        except Exception as exc:
            if isinstance(exc, db.StoreUnavailable) or db.is_transient(exc):
                # the store is down: the engine's own changes (facts, decisions) are kept
                # and written by the next flush; requests are rolled back by their caller
                self.degraded = f"store unavailable: {db._describe(exc)}"
            raise
        self.degraded = None
        self._publish_after_flush()

    def _commit(self) -> None:
        """Return once everything applied so far is durable (under the engine lock)."""
        with self.lock:
            self._flush_locked()

    def _publish_after_flush(self) -> None:
        """Stream what the flush made durable: its transitions, then its audit entries."""
        for w, tr in self.writer.last_transitions:
            self.streams.publish("state", transition_event(w, tr), correlation_id=correlation_of(w),
                                 workload=w.id, time=tr.time)
        for entry in self.writer.last_audit:
            self.streams.publish("audit", audit_event(entry), correlation_id=entry.correlation_id,
                                 workload=entry.workload, time=entry.time)

    # ================================================================ requests
    def request(self, req: Request) -> ApplyResult:
        """Apply one request through the one request path (see :mod:`mlwe.runtime.requests`).

        Returns once it is durable, or its rejection; raises :class:`StoreRefused`
        when the store cannot be reached (nothing was kept)."""
        return self.requests([req])[0]

    def requests(self, reqs: Sequence[Request]) -> list[ApplyResult]:
        """Independent requests (each applied all-or-nothing and audited on its own),
        made durable together: concurrent callers share one commit (group commit).

        Called with the engine lock held (a tick hook: the agent, workflows) they
        are made durable at once, without waiting for the group commit (whose
        leader may be waiting for this lock)."""
        if not reqs:
            return []
        if self.lock._is_owned():  # type: ignore[attr-defined]
            return self._durably(reqs)
        results = self.commits.run(reqs)
        if any(r.accepted and not r.duplicate for r in results):
            # a burst of submissions shares one scheduling cycle; anything else now
            self.wake(soon=all(r.action == "submit" for r in reqs))
        return results

    def _durably(
        self, reqs: Sequence[Request], extra: Callable[[Any], None] | None = None
    ) -> list[ApplyResult]:
        """Apply ``reqs`` and flush; if the store cannot take them, roll all of them back
        in memory (nothing is kept ahead of the store) and try each alone, so that one
        request the store refuses is rejected alone and never blocks the others."""
        with self.lock:
            if self.writer.pending():
                # the engine's own changes from a tick the store could not take: they go
                # first and alone, so that they are never blamed on a request
                try:
                    self._flush_locked()
                except Exception as exc:
                    raise StoreRefused(self._refusal(exc)) from exc
            marks = self._marks()
            sp = self.cp.savepoint()
            try:
                results = [self._apply_request(r) for r in reqs]
                if not any(r.accepted and not r.duplicate for r in results):
                    # nothing changed: the refusals' records go with the next tick's flush
                    return results
                hooks = [(r.on_durable, res) for r, res in zip(reqs, results)
                         if r.on_durable is not None and res.accepted and not res.duplicate]

                def in_transaction(c: Any) -> None:
                    for hook, res in hooks:
                        hook(c, res)
                    if extra is not None:
                        extra(c)

                try:
                    self._flush_locked(in_transaction if hooks else extra)
                    return results
                except Exception as exc:
                    failure: Exception = exc
                    self.cp.rollback_to(sp)
                    self._reset(marks)
            finally:
                self.cp.release(sp)
        if isinstance(failure, db.StoreUnavailable | StoreRefused) or db.is_transient(failure):
            raise StoreRefused(self._refusal(failure)) from failure
        if len(reqs) > 1:
            return [self._durably([r], extra)[0] for r in reqs]
        log.warning("request %s could not be stored: %s", reqs[0].action, failure)
        why = f"the store refused it: {db._describe(failure)}"
        return [ApplyResult(False, self.cp.version, (Rejection(-1, "request", "-", (why,)),))]

    @staticmethod
    def _refusal(exc: BaseException) -> str:
        return f"the store is unavailable, nothing was kept: {db._describe(exc)}"

    def _marks(self) -> tuple[Any, ...]:
        # what the reconciler is owed and what the store writer writes need no mark: both
        # are read from the control plane's effects, which rollback_to takes back with the
        # batches; the audit records queued for the requests are the writer's own
        return (self.writer.audit_mark(), self._decisions_noted, self.reconciler.dirty)

    def _reset(self, marks: tuple[Any, ...]) -> None:
        audit, noted, dirty = marks
        self.writer.drop_audit_after(audit)
        self.reconciler.dirty = dirty
        for _ in range(min(self._decisions_noted - noted, len(self.recent_decisions))):
            self.recent_decisions.pop()
        self._decisions_noted = noted

    def _note_decision(self, rec: DecisionRecord) -> None:
        self.recent_decisions.append(rec)
        self._decisions_noted += 1

    def _apply_request(self, req: Request) -> ApplyResult:
        """Screen, apply and audit one request (under the lock; durable with the next flush)."""
        cp = self.cp
        cid = req.correlation_id or new_correlation_id()
        refused = screen(req, cp.catalog) or self._inadmissible(req)
        if refused:
            result = ApplyResult(False, cp.version, tuple(refused))
        else:
            try:
                result = cp.apply(list(req.actions), req.expected_version, cause_id=cid,
                                  event_id=req.event_id)
            except InvariantViolation:
                raise
            except Exception as exc:  # a malformed request object: reject, never crash
                why = f"malformed request: {type(exc).__name__}: {exc}"
                result = ApplyResult(False, cp.version, (Rejection(-1, "request", "-", (why,)),))
        if result.duplicate:
            return result
        if result.accepted and req.action != "submit":
            self.reconciler.dirty = True  # e.g. an uncordon frees capacity with no transition
        if result.accepted or req.audit_refused:
            created = result.created
            workload = req.workload or (created[0] if len(created) == 1 else None)
            self.writer.note_audit(req.kind, req.actor, audit_payload(req, result),
                                   workload=workload, correlation_id=cid)
        return result

    def _inadmissible(self, req: Request) -> list[Rejection]:
        """Submissions that could never run: refused now, with the reason (not left to wait)."""
        out: list[Rejection] = []
        now = self.clock.now()
        for i, a in enumerate(req.actions):
            if isinstance(a, Submit) and isinstance(a.spec, WorkloadSpec):
                why = inadmissible(self.cp, a.spec, now)
                if why:
                    out.append(Rejection(i, "submit", a.spec.id or a.spec.name, tuple(why)))
        return out

    # ==================================================================== loop
    def tick(self) -> TickReport:
        """One iteration of the loop (see the module docstring): apply what came in
        (queued calls, the backend's facts), turn it into commands (a reconciler
        step, with a scheduling cycle), run the tick hooks on the state that step
        settled, step again if what they applied is worth a cycle, make all of it
        durable, send.

        What was applied is read as a value (the control plane's effects, taken by
        each ``reconciler.step()``), not collected on the side. The hooks run after
        the first step, not before a single one, because they must see the cycle's
        result: a hook run before the cycle would race the scheduler (a reschedule
        workflow would find its preemptor pending on freed resources and place it
        itself instead of leaving it to the cycle; the agent would analyse work the
        cycle is about to place), and the simulator (:mod:`mlwe.sim.driver`), on
        which the agent forecasts, runs them after the reconciler settled. The
        second step makes what the hooks applied commands in the same tick when it
        is worth a cycle (an accepted request other than a submission always is: it
        marks the reconciler dirty); otherwise the next tick's first step reads it."""
        rep = TickReport()
        with self.lock:
            # 1. apply: calls queued for the engine thread, the backend's facts
            while self._calls:
                self._guarded(self._calls.popleft(), "engine call failed", rep)
            events = self.backend.poll()
            rep.events = len(events)
            if events:
                self.reconciler.handle(events)
            # 2. commands: effects -> retries, scheduling cycle, starts -> commands
            cmds = self.reconciler.step()
            # 1'. apply: the hooks (agent, workflows), on the state the step settled, propose
            #     through the request path (before the step they would race the cycle)
            for hook in list(self.tick_hooks):
                self._guarded(partial(hook, self), "tick hook failed", rep)
            if self.reconciler.wants_step():
                cmds += self.reconciler.step()  # 2'. what the hooks applied, now
            # 3. flush: durable before the backend acts on it
            try:
                self._flush_locked()
            except Exception as exc:
                rep.errors.append(self.degraded or str(exc))
                # state is kept in memory and written by the next successful flush; do not
                # act on the backend before it is durable
                self._held_commands += cmds
                return rep
            if self._held_commands:
                cmds, self._held_commands = [*self._held_commands, *cmds], []
            rep.version = self.cp.version
        # 4. send
        if cmds:
            self.backend.send(cmds)
            for c in cmds:
                self.streams.publish("state", command_event(c), correlation_id=c.correlation_id,
                                     workload=c.workload)
        rep.commands = len(cmds)
        tel = self.backend.drain_telemetry()
        rep.telemetry = len(tel)
        if tel:
            self.telemetry.ingest(tel)
        now = self.clock.now()
        if now - self._last_maintenance >= self.config.maintenance_every_s:
            self._last_maintenance = now
            self.maintenance()
        self.ticks += 1
        return rep

    @staticmethod
    def _guarded(fn: Callable[[], object], what: str, rep: TickReport) -> None:
        """Run ``fn``; a failure is logged and reported, never stops the loop (a broken
        plug-in must not stop the engine)."""
        try:
            fn()
        except Exception as exc:
            log.exception(what)
            rep.errors.append(f"{type(exc).__name__}: {exc}")

    def maintenance(self) -> dict[str, int]:
        """Store buffered telemetry, downsample old samples, drop those past retention."""
        now = self.clock.now()
        try:
            merged, pruned = self.telemetry.maintenance(now)
            with self.lock:
                summary = self.summary()
            self.repo.save_snapshot(summary["version"], now, summary)
        except Exception:
            log.warning("store maintenance failed", exc_info=True)
            return {}
        return {"downsampled": merged, "pruned": pruned}

    @property
    def reads(self) -> ClusterReads:
        """The cluster for readers (:mod:`mlwe.core.reads`): the control plane, typed
        so that nothing but reads type-checks; hold ``lock`` while reading."""
        return self.cp

    def summary(self) -> dict[str, Any]:
        """A small state snapshot: counts by state, node status and GPU use (call under lock)."""
        cp = self.cp
        states: dict[str, int] = {}
        for w in cp.workloads.values():
            states[w.state.value] = states.get(w.state.value, 0) + 1
        nodes: dict[str, int] = {}
        gpu_total = gpu_free = 0
        for info in cp.capacity.nodes():
            st = cp.node_status(info.name).value
            nodes[st] = nodes.get(st, 0) + 1
            gpu_total += info.capacity.gpu
            gpu_free += cp.capacity.free(info.name).gpu
        return {
            "version": cp.version,
            "workloads": states,
            "nodes": nodes,
            "gpus": gpu_total // 1000,
            "gpus_allocated": (gpu_total - gpu_free) / 1000,
        }

    def start(self, period_s: float | None = None) -> None:
        """Run the loop on a background thread until :meth:`stop`."""
        if self._thread is not None:
            raise RuntimeError("the engine loop is already running")
        period = self.config.tick_s if period_s is None else period_s
        self._stop.clear()

        def loop() -> None:
            while not self._stop.is_set():
                # cleared before the tick: a wake that comes during it is not lost
                self._wake.clear()
                self._wake_now.clear()
                try:
                    self.tick()
                except Exception:
                    log.exception("engine tick failed")
                    time.sleep(min(1.0, period * 4))
                self._wake.wait(period)
                if self._wake.is_set() and not self._wake_now.is_set():
                    # only submissions so far: let the burst gather (a wake "now" cuts in)
                    self._wake_now.wait(self.config.admit_batch_s)

        self._thread = threading.Thread(target=loop, name="mlwe-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    def close(self, *, stop_workloads: bool = False) -> None:
        """Stop the loop, make everything durable, release the store (and the backend)."""
        self.stop()
        with self.lock:
            try:
                self._flush_locked()
            except Exception:
                log.warning("final flush failed", exc_info=True)
            self.telemetry.store()
        if stop_workloads:
            self.backend.close()
        self.repo.close()

    def run_until(self, predicate: Callable[[Engine], bool], timeout_s: float, period_s: float = 0.05) -> bool:
        """Tick until ``predicate`` holds (tests and examples): True if it did in time."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.tick()
            with self.lock:
                if predicate(self):
                    return True
            time.sleep(period_s)
        return False

    # ========================================================= restart repair
    def reconcile_backend(self) -> RestartReport:
        """After a restart: make the recovered state and the backend agree
        (:mod:`mlwe.runtime.restart`): facts applied one by one (one the state no
        longer allows is reported, not fatal), the report audited, the stops and
        starts sent at the next tick."""
        fix = repair(self.cp.workloads.values(), self.backend.inventory())
        for a in fix.facts:
            res = self.cp.apply([a], cause_id="restart-reconcile")
            if not res.accepted:
                log.warning("restart reconcile: %s refused: %s", a, "; ".join(res.reasons()))
        self.reconciler.resume()
        self.writer.note_audit("operator", "engine",
                               {"event": "restart-reconcile", **fix.report.to_dict()})
        if fix.commands:
            cmds = fix.commands
            self.call_soon(lambda: self.backend.send(cmds))
        self.last_restart = fix.report
        return fix.report

    # ================================================================ reading
    def health(self) -> dict[str, Any]:
        store = self.repo.health()
        return {
            "status": "degraded" if self.degraded or store.get("status") == "degraded" else "ok",
            "degraded": self.degraded,
            "quarantined": [str(q) for q in self.quarantined],
            "store": store,
            "backend": getattr(self.backend, "name", type(self.backend).__name__),
            "version": self.cp.version,
            "workloads": len(self.cp.workloads),
            "ticks": self.ticks,
            "loop_running": self._thread is not None and self._thread.is_alive(),
        }

