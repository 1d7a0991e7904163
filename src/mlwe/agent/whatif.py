"""What-if before commit: play a plan and doing nothing forward on a fork.

:func:`fork_state` copies the live control plane's nodes, queues and
workloads into a fresh control plane on a simulator clock (the live one is
only read; a test checks its :func:`state_digest` is unchanged). The
:class:`WhatIfForecaster` then runs the real scheduler and reconciler against a
:class:`ForecastBackend` (the simulator's backend, taking over what runs now)
for a horizon, twice: once with the plan's actions applied to the fork (the
fork's control plane verifies them, exactly as the live one would), once with
nothing. Each future is scored (lower is better) from deadlines met and
missed, flow time (the JCT proxy over the horizon), work lost to stops and
crashes, GPU time wasted on runs known to be useless, terminal failures and
starvation; the weights are part of every forecast.

Honest knowledge: durations are the users' estimates (``default_estimate_s``
where none was given), never a simulator's truth; what the agent believes
about the future beyond that (an out-of-memory loop, a diverged loss, a hung
run) enters as :class:`~mlwe.agent.model.Hazard` values from its findings.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.model import CandidatePlan, Forecast, Hazard, WhatIf
from mlwe.agent.triggers import SERVICE_LABEL
from mlwe.core.actions import Action, AddNode, SetQueue, Submit
from mlwe.core.backend import StartCommand
from mlwe.core.cluster import node_spec_of
from mlwe.core.controlplane import NOT_ITS_FAULT, ControlPlane
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import HOLDING, QUEUED, TERMINAL, State, Transition
from mlwe.core.model import Workload
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import WorkloadKind, WorkloadSpec
from mlwe.sim.backend import SimBackend, SimBackendConfig, SimRun
from mlwe.sim.driver import Driver
from mlwe.sim.kernel import Kernel


# ====================================================================== digest
def state_digest(cp: ControlPlane) -> str:
    """A digest of everything the control plane holds (to prove a fork left it alone)."""
    h = hashlib.blake2b(digest_size=16)

    def put(*parts: object) -> None:
        h.update(repr(parts).encode())

    put("version", cp.version, cp.holding_epoch, len(cp.decisions), sorted(cp.counters.items()))
    for name in sorted(cp.capacity.node_names()):
        put("node", name, cp.capacity.status(name), cp.capacity.free(name).as_tuple(),
            cp.capacity.free_devices(name), sorted(cp.on_node.get(name, {})))
    for qname in sorted(cp.queues):
        q = cp.queues[qname]
        put("queue", qname, q.spec.model_dump_json(), list(q.usage))
    for wid in sorted(cp.workloads):
        w = cp.workloads[wid]
        put("w", wid, w.state, w.attempt, w.failures, w.priority, w.placement, w.progress,
            w.work_done, w.started_at, w.victims, w.preempted_by, len(w.history),
            w.spec.model_dump_json(), w.pending_reason)
    put("queued", list(cp.queued))
    return h.hexdigest()


# ======================================================================== fork
def fork_state(cp: ControlPlane, clock: Any) -> ControlPlane:
    """A new control plane on ``clock`` holding a copy of ``cp``'s state.

    Live workloads are copied (their history list too); terminal ones are
    shared, since nothing can change a succeeded or cancelled workload. The
    live control plane is only read.
    """
    fork = ControlPlane(
        clock, catalog=cp.catalog, check_invariants=True, decision_sink=_discard
    )
    for name in cp.capacity.node_names():  # each with its status
        r = fork.apply([AddNode(node_spec_of(cp, name))])
        if not r.accepted:
            raise RuntimeError(f"fork: node {name}: {'; '.join(r.reasons())}")
    r = fork.apply([SetQueue(q.spec) for q in cp.queues.values()])
    if not r.accepted:
        raise RuntimeError(f"fork: {'; '.join(r.reasons())}")
    copies = [
        w if w.state in TERMINAL else dataclasses.replace(w, history=list(w.history))
        for w in cp.workloads.values()
    ]
    fork.restore(copies, cp.version)
    return fork


def _discard(_: DecisionRecord) -> None:
    return None


def verify_on_fork(cp: ControlPlane, actions: Sequence[Action]) -> tuple[str, ...]:
    """The reasons ``cp`` would reject ``actions`` with, found on a fork (empty: accepted)."""
    fork = fork_state(cp, _Frozen(cp.now()))
    return tuple(fork.apply(list(actions), cause_id="what-if:verify").reasons())


# ===================================================================== backend
class ForecastBackend(SimBackend):
    """The simulated backend, able to take over runs already in progress and to
    play the agent's hazards (crash loops, useless runs, hung runs). Workloads
    that checkpoint do so on the stop signal (build it with
    ``checkpoint_on_signal=True``). It overrides only the simulator's public
    run-model hooks."""

    nodes: set[str]

    def setup(self, hazards: Iterable[Hazard]) -> None:
        self.hazards: dict[str, list[Hazard]] = {}
        for hz in hazards:
            if hz.kind == "node-failure":
                if hz.workload in self._node_names():
                    self.fail_node(self.kernel.clock.t + hz.after_s, hz.workload)
                continue
            self.hazards.setdefault(hz.workload, []).append(hz)
        self.wasted_gpu_s = 0.0
        self._waste_since: dict[str, float] = {}
        self._hung: set[tuple[str, int]] = set()

    def _node_names(self) -> set[str]:
        return self.nodes

    def active(self, wid: str, attempt: int, spec_memory: int) -> list[Hazard]:
        out = []
        for hz in self.hazards.get(wid, ()):
            if hz.attempt is not None and hz.attempt != attempt:
                continue
            if hz.cleared_by_memory is not None and spec_memory >= hz.cleared_by_memory:
                continue
            out.append(hz)
        return out

    def adopt(self, w: Workload, remaining: float) -> None:
        """Take over ``w``'s current run (it runs now on the live backend)."""
        now = self.kernel.clock.t
        overhead = w.spec.restart_cost if w.run_base_work > 0 else 0.0
        t_start = w.started_at if w.started_at is not None else now
        run = self.take_over(w.id, w.attempt, w.spec, tuple(a.node for a in w.placement),
                             t_start, overhead, w.run_base_work,
                             confirm_start=w.state is State.STARTING)
        self._arm(run, now + remaining)

    def on_start(self, c: StartCommand) -> None:
        run = self.run_of(c.workload)
        if run is not None and run.attempt == c.attempt and not run.finished:
            self._arm(run, None)

    def _arm(self, run: SimRun, finish_at: float | None) -> None:
        """Schedule the run's end: its natural finish, or what its hazards make of it."""
        k = self.kernel
        hz = self.active(run.workload, run.attempt, run.spec.resources.memory)
        kinds = {h.kind for h in hz}
        if kinds & {"waste", "hang"}:
            self._waste_since[run.workload] = max(k.clock.t, run.t_start)
        if "hang" in kinds:
            # a hung run holds its resources and never finishes (its natural
            # finish, if the start scheduled one, is ignored)
            self._hung.add((run.workload, run.attempt))
        elif finish_at is not None:
            self.finish_at(finish_at, run.workload, run.attempt)
        crash = [h for h in hz if h.kind == "crash"]
        if crash:
            t = max(k.clock.t, run.t_start + run.overhead + min(h.after_s for h in crash))
            k.at(t, self._hazard_crash, (run.workload, run.attempt, crash[0].cause or "oom"))

    def on_finish(self, workload: str, attempt: int) -> bool:
        if (workload, attempt) in self._hung:
            return False
        self._account_waste(workload)
        return True

    def _hazard_crash(self, arg: tuple[str, int, str]) -> None:
        wid, attempt, cause = arg
        if self.current(wid, attempt) is None:
            return
        self._account_waste(wid)
        self.crash(wid, attempt, 137 if cause == "oom" else 1, cause)

    def on_release(self, workload: str, attempt: int) -> None:
        if self.current(workload, attempt) is not None:
            self._account_waste(workload)

    def _account_waste(self, wid: str) -> None:
        since = self._waste_since.pop(wid, None)
        run = self.run_of(wid)
        if since is not None and run is not None:
            gpus = run.spec.resources.gpu * run.spec.replicas / 1000
            self.wasted_gpu_s += gpus * max(0.0, self.kernel.clock.t - since)

    def close_waste(self) -> None:
        for wid in list(self._waste_since):
            self._account_waste(wid)


def service_of(w: Workload) -> str | None:
    """The inference service a workload serves (its label, else its own id)."""
    if w.spec.kind is not WorkloadKind.INFERENCE:
        return None
    return w.spec.labels.get(SERVICE_LABEL, w.id)


# ===================================================================== scoring
@dataclass(frozen=True)
class ScoreWeights:
    """Points per unit; a forecast's score is the weighted sum (lower is better)."""

    deadline_missed: float = 10.0  # per workload that misses its deadline
    lateness_h: float = 1.0  # per hour past deadlines
    flow_h: float = 0.05  # per hour a workload spends in the system within the horizon
    lost_gpu_h: float = 0.5  # per GPU-hour of work lost to stops and crashes
    wasted_gpu_h: float = 0.5  # per GPU-hour spent on runs known to be useless
    failed: float = 5.0  # per workload that fails for good
    starved_h: float = 1.0  # per hour waited beyond the starvation threshold
    overload_h: float = 2.0  # per hour an overloaded service runs fewer replicas than it needs

    def as_dict(self) -> dict[str, float]:
        return dataclasses.asdict(self)


@dataclass
class WhatIfConfig:
    horizon_s: float = 6 * 3600.0
    #: the plan must beat doing nothing by max(margin_abs, margin_rel x |nothing|)
    margin_abs: float = 0.05
    margin_rel: float = 0.02
    default_estimate_s: float = 3600.0
    starve_threshold_s: float = 2 * 3600.0
    grace_s: float = 30.0
    eviction_delay_s: float = 5.0
    retry_base_s: float = 30.0
    weights: ScoreWeights = field(default_factory=ScoreWeights)
    #: check invariants after every batch of a forecast too (tests turn it on)
    check_forecast_invariants: bool = False


class _Tracker:
    """Listens to the fork's transitions for the KPIs."""

    def __init__(self, cp: ControlPlane, t0: float, overloads: dict[str, int] | None = None) -> None:
        self.t0 = t0
        self.needs = overloads or {}
        self.running: dict[str, int] = dict.fromkeys(self.needs, 0)
        self.last_t: dict[str, float] = dict.fromkeys(self.needs, t0)
        self.overload_s = 0.0
        self.finish: dict[str, float] = {}
        self.failed_for_good: set[str] = set()
        self.wait_start: dict[str, float] = {}
        self.starved_s = 0.0
        self.threshold = 0.0
        for w in cp.workloads.values():
            if w.state in QUEUED:
                since = w.history[-1].time if w.history else w.submit_time
                self.wait_start[w.id] = since
            svc = service_of(w)
            if svc in self.running and w.state is State.RUNNING:
                self.running[svc] += 1
        cp.listeners.append(self.on)

    def _service_step(self, svc: str, t: float, delta: int) -> None:
        if self.running[svc] < self.needs[svc]:
            self.overload_s += t - self.last_t[svc]
        self.last_t[svc] = t
        self.running[svc] += delta

    def on(self, w: Workload, tr: Transition) -> None:
        t = tr.time
        svc = service_of(w)
        if svc in self.running and (tr.target is State.RUNNING) != (tr.source is State.RUNNING):
            self._service_step(svc, t, 1 if tr.target is State.RUNNING else -1)
        if tr.target in QUEUED:
            self.wait_start[w.id] = t
        elif tr.source in QUEUED and w.id in self.wait_start:
            self._starved(t - self.wait_start.pop(w.id))
        if tr.target is State.SUCCEEDED:
            self.finish[w.id] = t
        elif tr.target is State.FAILED and (
            w.failures > w.spec.max_retries and w.failure_cause not in NOT_ITS_FAULT
        ):
            self.failed_for_good.add(w.id)

    def _starved(self, waited: float) -> None:
        self.starved_s += max(0.0, waited - self.threshold)

    def close(self, end: float) -> None:
        for svc in self.running:
            self._service_step(svc, end, 0)
        for since in self.wait_start.values():
            self._starved(end - since)
        self.wait_start.clear()


def score(kpis: dict[str, float], w: ScoreWeights) -> tuple[float, dict[str, float]]:
    terms = {
        "deadline_missed": w.deadline_missed * kpis["deadlines_missed"],
        "lateness": w.lateness_h * kpis["lateness_s"] / 3600,
        "flow": w.flow_h * kpis["flow_s"] / 3600,
        "lost_work": w.lost_gpu_h * kpis["lost_gpu_s"] / 3600,
        "wasted": w.wasted_gpu_h * kpis["wasted_gpu_s"] / 3600,
        "failed": w.failed * kpis["failed"],
        "starved": w.starved_h * kpis["starved_s"] / 3600,
        "overload": w.overload_h * kpis["overload_s"] / 3600,
    }
    return sum(terms.values()), {k: round(v, 6) for k, v in terms.items()}


# ==================================================================== snapshot
@dataclass(frozen=True)
class Snapshot:
    """A private copy of the live state, taken under the caller's lock (a cheap copy).

    Forecasts, verification and the tools read it with no lock held: nothing
    else holds a reference to ``cp``, and its clock stands still at ``time``.
    What the agent believes (hazards) and expects (arrivals) is captured with it."""

    cp: ControlPlane
    version: int  # the live version it was taken at: a plan decided on it proposes that
    time: float
    hazards: tuple[Hazard, ...] = ()
    arrivals: tuple[tuple[float, WorkloadSpec], ...] = ()


# ================================================================== forecaster
class WhatIfForecaster:
    """Forks the live state and plays futures on it; implements the tools' Forecaster.

    Without ``base``, each call forks the live control plane (the caller holds
    whatever lock guards it, for the whole call). With ``base`` (a
    :class:`Snapshot` from :meth:`snapshot`), every call works on that private
    copy and needs no lock: :meth:`at` returns such a bound forecaster."""

    def __init__(
        self,
        cp: ControlPlane,
        *,
        config: WhatIfConfig | None = None,
        scheduler_factory: Callable[[], Scheduler] = Scheduler,
        hazards: Callable[[], Sequence[Hazard]] | None = None,
        arrivals: Callable[[], Sequence[tuple[float, WorkloadSpec]]] | None = None,
    ) -> None:
        self.cp = cp
        self.config = config or WhatIfConfig()
        self.scheduler_factory = scheduler_factory
        self.hazards = hazards or (lambda: ())
        #: expected arrivals (seconds from now, spec): recurring streams seen lately
        self.arrivals = arrivals or (lambda: ())
        self.runs = 0
        self.forecast_s = 0.0  # time spent playing futures, in total
        #: called between the steps of a forecast (see :class:`YieldGil`); None: never
        self.pause: Callable[[], None] | None = None
        self._cache: dict[tuple[Any, ...], Forecast] = {}

    # ------------------------------------------------------------- snapshot
    def snapshot(self) -> Snapshot:
        """Copy the live state (call under the lock that guards it; it is quick)."""
        now = self.cp.now()
        return Snapshot(fork_state(self.cp, _Frozen(now)), self.cp.version, now,
                        tuple(self.hazards()), tuple(self.arrivals()))

    def at(self, base: Snapshot) -> SnapshotForecaster:
        """A forecaster working on ``base`` only (no lock needed)."""
        return SnapshotForecaster(self, base)

    # ------------------------------------------------------------- protocol
    def verify(self, actions: Sequence[Action], *, base: Snapshot | None = None) -> tuple[str, ...]:
        return verify_on_fork(base.cp if base is not None else self.cp, actions)

    def what_if(
        self, plan: CandidatePlan, horizon_s: float | None = None, *, base: Snapshot | None = None
    ) -> WhatIf:
        cfg = self.config
        h = horizon_s or cfg.horizon_s
        if base is not None:
            hazards, version, t0 = base.hazards, base.version, base.time
        else:
            hazards, version, t0 = tuple(self.hazards()), self.cp.version, self.cp.now()
        key = (version, t0, h, hazards)
        nothing = self._cache.get(key)
        if nothing is None:
            nothing = self._cache[key] = self.forecast((), hazards, h, "nothing", base=base)
        plan_fc = self.forecast(plan.actions, hazards, h, "plan", clears=plan.clears, base=base)
        need = max(cfg.margin_abs, cfg.margin_rel * abs(nothing.score))
        better = plan_fc.verified and plan_fc.score < nothing.score - need
        if not plan_fc.verified:
            summary = "plan not verified on the fork: " + "; ".join(plan_fc.rejections[:3])
        else:
            summary = (
                f"plan scores {plan_fc.score:.3f} vs {nothing.score:.3f} doing nothing over"
                f" {h / 3600:g}h ({'better' if better else 'not better'} by the margin"
                f" {need:.3f})"
            )
        if len(self._cache) > 64:
            self._cache.clear()
        return WhatIf(plan.id, plan_fc, nothing, better, need, summary, version)

    # -------------------------------------------------------------- forecast
    def forecast(
        self,
        actions: Sequence[Action],
        hazards: Sequence[Hazard],
        horizon_s: float,
        label: str,
        clears: Sequence[str] = (),
        *,
        base: Snapshot | None = None,
    ) -> Forecast:
        started = time.perf_counter()
        try:
            return self._forecast(actions, hazards, horizon_s, label, clears, base)
        finally:
            self.forecast_s += time.perf_counter() - started

    def _forecast(
        self,
        actions: Sequence[Action],
        hazards: Sequence[Hazard],
        horizon_s: float,
        label: str,
        clears: Sequence[str],
        base: Snapshot | None,
    ) -> Forecast:
        cfg = self.config
        self.runs += 1
        src = base.cp if base is not None else self.cp
        t0 = base.time if base is not None else self.cp.now()
        kernel = Kernel(start=t0)
        fork = fork_state(src, kernel.clock)
        overloads = {h.workload: h.replicas or 1 for h in hazards if h.kind == "overload"}
        tracker = _Tracker(fork, t0, overloads)
        tracker.threshold = cfg.starve_threshold_s
        verified = True
        rejections: tuple[str, ...] = ()
        if actions:
            r = fork.apply(list(actions), cause_id=f"what-if:{label}")
            verified, rejections = r.accepted, tuple(r.reasons())
            if not verified:
                return Forecast(label, horizon_s, False, rejections)
        # the plan was verified (with the invariant check) above; the future played
        # below is a forecast, not state: skip the per-batch check there for speed
        fork.check_invariants = self.config.check_forecast_invariants
        durations: dict[str, float] = {}
        backend = ForecastBackend(
            kernel, durations,
            SimBackendConfig(eviction_delay_s=cfg.eviction_delay_s, checkpoint_on_signal=True),
        )
        cleared = set(clears)
        backend.nodes = set(fork.capacity.node_names())
        backend.setup(h for h in hazards if h.workload not in cleared)
        est_default = cfg.default_estimate_s
        for w in fork.workloads.values():
            if w.state in TERMINAL:
                continue
            est = w.spec.estimated_duration
            if w.work_done > 0:
                backend.saved[w.id] = w.work_done
            running = w.state in HOLDING and w.started_at is not None
            if running or w.state is State.STARTING:
                rem = w.remaining_estimate(t0)
                if rem is None:
                    rem = max(est_default - w.runtime(t0), 0.25 * est_default)
                done = w.run_base_work + max(0.0, w.runtime(t0))
                durations[w.id] = max(est or 0.0, done + rem)
                backend.adopt(w, rem)
            else:
                durations[w.id] = est or est_default
        rec = Reconciler(fork, self.scheduler_factory(), grace_s=cfg.grace_s,
                         retry_base_s=cfg.retry_base_s)
        rec.resume()
        drv = Driver(kernel, rec, backend, before_step=self.pause)
        drv.start()
        end = t0 + horizon_s

        def arrive(spec: WorkloadSpec) -> None:
            assert spec.id is not None
            durations[spec.id] = spec.estimated_duration or est_default
            fork.apply([Submit(spec)], cause_id="what-if:arrival")
            rec.dirty = True

        arrivals = base.arrivals if base is not None else tuple(self.arrivals())
        for offset, spec in arrivals:
            if 0 <= offset < horizon_s and spec.id not in fork.workloads:
                kernel.at(t0 + offset, arrive, spec)
        drv.run(end)
        backend.close_waste()
        tracker.close(end)
        kpis = self._kpis(fork, tracker, backend, t0, end)
        total, terms = score(kpis, cfg.weights)
        return Forecast(label, horizon_s, verified, rejections, kpis, total, terms)

    def _kpis(
        self, fork: ControlPlane, tr: _Tracker, backend: ForecastBackend, t0: float, end: float
    ) -> dict[str, float]:
        met = missed = 0
        late = 0.0
        flow = 0.0
        alive = 0
        for w in fork.workloads.values():
            fin = tr.finish.get(w.id)
            was_live = w.id in tr.finish or w.state not in TERMINAL
            if not was_live:
                continue
            alive += 1
            start = max(t0, w.submit_time)
            flow += max(0.0, (fin if fin is not None else end) - start)
            if w.deadline is None or w.id in tr.failed_for_good:
                if w.deadline is not None:
                    missed += 1
                continue
            if fin is not None:
                done_at = fin
            elif w.state in (State.CANCELLED, State.FAILED):
                continue  # stopped on purpose (or failing): not a deadline to meet
            else:
                rem = w.remaining_estimate(end)
                done_at = end + (rem if rem is not None else self.config.default_estimate_s)
            over = max(0.0, done_at - w.deadline)
            if over > 0:
                missed += 1
                late += over
            else:
                met += 1
        return {
            "workloads": float(alive),
            "completed": float(len(tr.finish)),
            "deadlines_met": float(met),
            "deadlines_missed": float(missed),
            "lateness_s": round(late, 3),
            "flow_s": round(flow, 3),
            "mean_flow_s": round(flow / alive, 3) if alive else 0.0,
            "lost_gpu_s": round(backend.lost_gpu_s, 3),
            "wasted_gpu_s": round(backend.wasted_gpu_s, 3),
            "failed": float(len(tr.failed_for_good)),
            "starved_s": round(tr.starved_s, 3),
            "overload_s": round(tr.overload_s, 3),
        }


class YieldGil:
    """Lets other threads run during a long computation on a background thread.

    A thread computing in pure Python holds the GIL; another thread that waits
    on I/O (the engine flushing to its database, statement by statement) must
    win the GIL back after each call, and waits up to the interpreter's switch
    interval (5 ms) every time: a flush of a hundred statements then takes
    half a second. Called between forecast steps, this sleeps ``sleep_s``
    once at least ``every_s`` has passed since it last did, so the waiting
    thread gets the GIL within about ``every_s`` and a share of the CPU while
    the engine is busy. The defaults (a third of the time given away) cut the
    engine's tick p99 and worst case with a busy agent
    (``benchmarks/agent_tick_latency.py``) at no measurable cost to the
    deliberation's wall time on a loaded two-core machine."""

    def __init__(self, every_s: float = 0.002, sleep_s: float = 0.001) -> None:
        self.every_s = every_s
        self.sleep_s = sleep_s
        self._last = time.perf_counter()

    def __call__(self) -> None:
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            time.sleep(self.sleep_s)
            self._last = time.perf_counter()


class SnapshotForecaster:
    """The what-if forecaster bound to one :class:`Snapshot` (the tools' Forecaster)."""

    def __init__(self, engine: WhatIfForecaster, base: Snapshot) -> None:
        self.engine = engine
        self.base = base

    @property
    def version(self) -> int:
        return self.base.version

    def what_if(self, plan: CandidatePlan, horizon_s: float | None = None) -> WhatIf:
        return self.engine.what_if(plan, horizon_s, base=self.base)

    def verify(self, actions: Sequence[Action]) -> tuple[str, ...]:
        return self.engine.verify(actions, base=self.base)


class _Frozen:
    """A clock that stays at one time (verification forks do not move)."""

    def __init__(self, t: float) -> None:
        self.t = t

    def now(self) -> float:
        return self.t


__all__ = [
    "ForecastBackend",
    "ScoreWeights",
    "Snapshot",
    "SnapshotForecaster",
    "WhatIfConfig",
    "WhatIfForecaster",
    "YieldGil",
    "fork_state",
    "state_digest",
    "verify_on_fork",
]
