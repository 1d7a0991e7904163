"""Scheduling policies for replays: mlwe's default and the baselines, as plug-ins.

Each baseline is a :class:`~mlwe.core.scheduler.Scheduler` configuration (an
ordering plug-in plus flags) or a small subclass whose ``prepare`` hook
proposes ``SetPriority`` actions (verified and applied by the control plane
like any other action); never a fork of the simulator. Exact semantics are in
each factory's docstring and in ``POLICY_SEMANTICS`` (printed in reports).

Honest knowledge (DESIGN.md): a factory receives the trace's TRUE durations,
which only the simulator should know. Policies that read them say "oracle" in
their label; the others ignore the mapping. Every baseline ignores user
estimates and the workloads' static priorities unless its docstring says
otherwise.

Vocabulary shared by the docstrings:

- "greedy backfill": jobs are tried in the policy's order; one that does not
  fit waits, and any later job that fits may start ahead of it, with no
  reservation for the blocked one (``SchedulerConfig(backfill=False)``).
- decisions: one scheduling cycle at each simulated moment where something
  changed (no periodic rounds); Tiresias adds wakeups at demotion and
  promotion moments.
- "preemption": the core's rule, unchanged: a queued job may evict running
  jobs of STRICTLY lower effective priority; the victims are the cheapest
  minimal set (lost work since the last checkpoint + restart cost), they
  checkpoint and requeue, and resume from their last checkpoint. Eviction
  cost and delay are the simulator's normal model.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlwe.core.actions import Action, SetPriority
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import HOLDING, QUEUED, State, Transition
from mlwe.core.model import Queue, Workload
from mlwe.core.policies.preemption import LowestPriorityVictims
from mlwe.core.scheduler import Scheduler, SchedulerConfig, default_scheduler
from mlwe.sim.checkpoint import FREE_PREEMPTION, CheckpointModel

INF = math.inf

#: Effective priority of the best level (level 0); level k gets LEVEL_TOP - k.
#: Far inside the control plane's 0..1_000_000 range.
LEVEL_TOP = 1000
_MAX_LEVEL = 999

#: Tiresias defaults: the authors' public simulator (SymbioticLab/Tiresias,
#: ``dlas-gpu``) runs three queues, i.e. two thresholds, at 3,250 and 7,200
#: GPU-seconds (simulator/jobs.py: ``queue_limit = [3250, 7200, 18000]``, of
#: which a 3-queue run uses the first two).
TIRESIAS_THRESHOLDS_GPU_S: tuple[float, ...] = (3250.0, 7200.0)

#: Effective priority of the best fine level, for policies that rank by an exact
#: quantity (srtf-free): level k gets FINE_TOP - k, k < FINE_TOP.
FINE_TOP = 100_000
#: fine levels per doubling of remaining time: neighbouring levels differ by
#: 0.07% (70 s at 28 h); finer would re-rank running jobs at nearly every cycle
FINE_PER_OCTAVE = 1000

_RUNNING = (State.RUNNING, State.PREEMPTING)  # the process runs (attained service grows)
_DONE = (State.SUCCEEDED, State.CANCELLED)


# ---------------------------------------------------------------- orderings
class _Fifo:
    """Arrival order only (priorities ignored)."""

    name = "fifo"

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        return sorted(queued, key=lambda w: w.seq)


class _OracleShortestFirst:
    """True (total) duration, shortest first; arrival breaks ties."""

    name = "sjf-oracle"

    def __init__(self, durations: Mapping[str, float]) -> None:
        self.durations = durations

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        d = self.durations
        return sorted(queued, key=lambda w: (d.get(w.id, INF), w.seq))


class _EarliestDeadline:
    """Absolute deadline, earliest first; no deadline after every deadline; then arrival."""

    name = "edf"

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        return sorted(
            queued, key=lambda w: (w.deadline is None, w.deadline or 0.0, w.seq)
        )


class _StaticPriority:
    """The spec's (static) priority, highest first; then arrival."""

    name = "static-priority"

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        return sorted(queued, key=lambda w: (-w.spec.priority, w.seq))


class _OracleRemainingFirst:
    """Effective priority (the SRTF level), then true remaining time, then arrival."""

    name = "srtf-oracle"

    def __init__(self, remaining: Callable[[Workload, float], float]) -> None:
        self.remaining = remaining

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        rem = self.remaining
        return sorted(queued, key=lambda w: (-w.priority, rem(w, now), w.seq))


class _LevelFifo:
    """Effective priority (the queue level), then the moment the job entered that
    queue (arrival for queue 0, demotion for the others), then arrival: FIFO
    within a queue, as the authors' simulator appends a demoted job to the end of
    the next queue."""

    name = "las-queue-fifo"

    def __init__(self, entered: Mapping[str, tuple[int, float]] | None = None) -> None:
        self.entered = entered if entered is not None else {}

    def order(
        self, queued: Sequence[Workload], queues: Mapping[str, Queue], total_gpu: int, now: float
    ) -> list[Workload]:
        entered = self.entered

        def key(w: Workload) -> tuple[int, float, int]:
            e = entered.get(w.id)
            return (-w.priority, e[1] if e is not None and e[0] == w.priority else -INF, w.seq)

        return sorted(queued, key=key)


# --------------------------------------------------- priority-level policies
class _LevelScheduler(Scheduler):
    """A scheduler whose ``prepare`` keeps each live workload's effective priority at
    ``LEVEL_TOP - level(w)``, through SetPriority actions the control plane verifies.

    Levels are recomputed only when they can change: after a workload's state
    changes (seen through the control plane's transition stream, read-only) and
    at the moment a subclass says a level changes by time alone
    (``next_change``), so a cycle costs what changed, not what is live.
    """

    #: set by policies whose semantics include the checkpoint model (the "-free" ones)
    checkpoint_model: CheckpointModel | None = None
    #: effective priority of level 0, and the last level
    top = LEVEL_TOP
    max_level = _MAX_LEVEL
    #: recompute every running workload's level before each cycle (a level that
    #: follows remaining time exactly changes continuously while it runs)
    refresh_running = False

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self._cp: ControlPlane | None = None
        #: id -> (effective priority, time it entered that level): FIFO within a level
        self.entered: dict[str, tuple[int, float]] = {}
        self._reset()

    def _reset(self) -> None:
        self._stale: dict[str, None] = {}  # workloads whose level must be recomputed
        self._due: list[tuple[float, int, str]] = []  # (time a level changes, generation, id)
        self._gen: dict[str, int] = {}
        self._want: dict[str, tuple[int, int]] = {}  # id -> (priority, level) to propose
        self._running: dict[str, None] = {}
        self.entered.clear()

    # ------------------------------------------------------------- subclass API
    def level(self, w: Workload, now: float) -> int:
        raise NotImplementedError

    def next_change(self, w: Workload, now: float) -> float | None:
        """When ``w``'s level next changes with no state change (None: it does not)."""
        return None

    def forget(self, wid: str) -> None:
        """``wid`` finished: drop what the policy keeps about it."""

    def reason(self, level: int) -> str:
        return f"{self.name} level {level}"

    # ---------------------------------------------------------------- machinery
    def _attach(self, cp: ControlPlane) -> None:
        if self._cp is cp:
            return
        self._cp = cp
        self._reset()
        for w in cp.workloads.values():
            if w.state not in _DONE:
                self._stale[w.id] = None

        def seen(w: Workload, tr: Transition) -> None:
            if self._cp is cp:
                self._stale[w.id] = None
                if tr.target in _RUNNING:
                    self._running[w.id] = None
                else:
                    self._running.pop(w.id, None)

        cp.listeners.append(seen)

    def _refresh(self, cp: ControlPlane) -> None:
        self._attach(cp)
        now = cp.now()
        due = self._due
        gens = self._gen
        while due and due[0][0] <= now:
            _, gen, wid = heapq.heappop(due)
            if gens.get(wid) == gen:
                self._stale[wid] = None
        if self._stale:
            stale, self._stale = self._stale, {}
            self._relevel(cp, stale, now)
        if self.refresh_running and self._running:
            # a running level only improves with time, so it matters only where a
            # waiting workload ranks above its recorded priority: refresh those
            hi = -1
            want = self._want
            for q in cp.queued_workloads():
                got = want.get(q.id)
                hi = max(hi, got[0] if got is not None else q.priority)
            workloads = cp.workloads
            lagging = [
                wid for wid in self._running
                if wid in workloads and workloads[wid].priority < hi
            ]
            if lagging:
                self._relevel(cp, lagging, now)

    def _relevel(self, cp: ControlPlane, stale: Iterable[str], now: float) -> None:
        gens = self._gen
        due = self._due
        workloads = cp.workloads
        entered = self.entered
        top = self.top
        for wid in stale:
            w = workloads.get(wid)
            if w is None or w.state in _DONE:
                gens.pop(wid, None)
                self._want.pop(wid, None)
                entered.pop(wid, None)
                self.forget(wid)
                continue
            if w.state not in QUEUED and w.state not in HOLDING:
                continue  # failed, waiting for a retry: its level is set when it requeues
            lvl = min(self.max_level, max(0, self.level(w, now)))
            prio = top - lvl
            e = entered.get(wid)
            if e is None:
                entered[wid] = (prio, w.submit_time)
            elif e[0] != prio:
                entered[wid] = (prio, now)
            self._want[wid] = (prio, lvl)
            gen = gens[wid] = gens.get(wid, 0) + 1
            t = self.next_change(w, now)
            if t is not None and t < INF:
                heapq.heappush(due, (max(t, math.nextafter(now, INF)), gen, wid))

    def prepare(self, cp: ControlPlane) -> list[Action]:
        self._refresh(cp)
        if not self._want:
            return []
        out: list[Action] = []
        workloads = cp.workloads
        for wid, (prio, lvl) in self._want.items():
            w = workloads[wid]
            if w.priority != prio and w.state not in _DONE:
                out.append(SetPriority(wid, prio, self.reason(lvl)))
        self._want.clear()
        return out

    def _next_due(self, cp: ControlPlane) -> float | None:
        self._refresh(cp)
        due = self._due
        gens = self._gen
        while due and gens.get(due[0][2]) != due[0][1]:
            heapq.heappop(due)  # superseded
        return due[0][0] if due else None


def power_of_two_level(seconds: float) -> int:
    """0 for up to 1 s, else ceil(log2(seconds)): (2^(k-1), 2^k] -> k (exact at powers of two)."""
    if seconds <= 1.0:
        return 0
    m, e = math.frexp(seconds)  # seconds = m * 2**e, 0.5 <= m < 1
    return e - 1 if m == 0.5 else e


class OracleSrtf(_LevelScheduler):
    """Preemptive SRTF on oracle remaining time, discretised to powers of two."""

    def __init__(self, durations: Mapping[str, float], *, exact: bool = False) -> None:
        self.durations = durations
        #: exact: levels follow remaining time to 0.0017% (srtf-free) instead of
        #: powers of two
        self.exact = exact
        if exact:
            self.top = FINE_TOP
            self.max_level = FINE_TOP - 1
            self.refresh_running = True
        super().__init__(
            ordering=_OracleRemainingFirst(self.remaining),
            config=SchedulerConfig(
                preemption=True, backfill=False,
                max_failed_preemption_searches=256 if exact else 16,
            ),
            preemption=LowestPriorityVictims() if exact else None,
            name="srtf-free" if exact else "srtf",
        )
        if exact:
            self.checkpoint_model = FREE_PREEMPTION

    def _overhead_end(self, w: Workload) -> float | None:
        """When the current run's useful work starts (after a resumed run's restart
        cost); None when it is not running."""
        if w.started_at is None or w.state not in _RUNNING:
            return None
        return w.started_at + (w.spec.restart_cost if w.run_base_work > 0 else 0.0)

    def remaining(self, w: Workload, now: float) -> float:
        """True duration minus the work done, as the control plane counts it: saved
        work, plus the time running in the current attempt after its restart cost."""
        done = w.work_done
        t0 = self._overhead_end(w)
        if t0 is not None:
            done = max(done, w.run_base_work + max(0.0, now - t0))
        return max(0.0, self.durations.get(w.id, INF) - done)

    def level(self, w: Workload, now: float) -> int:
        rem = self.remaining(w, now)
        if self.exact:
            if rem == INF:
                return self.max_level
            return min(self.max_level, int(math.log2(1.0 + rem) * FINE_PER_OCTAVE))
        return _MAX_LEVEL if rem == INF else power_of_two_level(rem)

    def next_change(self, w: Workload, now: float) -> float | None:
        if self.exact:
            return None  # running levels are refreshed before every cycle
        t0 = self._overhead_end(w)
        if t0 is None:
            return None  # waiting: its remaining time does not change
        rem = self.remaining(w, now)
        lvl = power_of_two_level(rem) if rem < INF else 0
        if lvl == 0:
            return None
        return max(now, t0) + rem - 2.0 ** (lvl - 1)

    def reason(self, level: int) -> str:
        if self.exact:
            return f"srtf-free: oracle remaining time ~{2.0 ** (level / FINE_PER_OCTAVE) - 1:.0f} s"
        if not level:
            return "srtf: oracle remaining time <= 1 s"
        return f"srtf: oracle remaining time in (2^{level - 1}, 2^{level}] s"


@dataclass(slots=True)
class _Service:
    """What Tiresias tracks per job, read from the job's lifecycle history."""

    seen: int = 0  # history entries already read
    executed_s: float = 0.0  # closed running intervals, all attempts
    running_since: float | None = None
    #: closed waiting intervals, counted only once the job has run since its last
    #: promotion (as Tiresias' ``last_pending_time``)
    waited_s: float = 0.0
    waiting_since: float | None = None
    base_executed_s: float = 0.0  # executed_s at the last starvation promotion
    base_waited_s: float = 0.0  # waited_s at the last starvation promotion


class Tiresias(_LevelScheduler):
    """Discretised 2D-LAS (Tiresias, NSDI'19): queue level from attained GPU-seconds."""

    def __init__(
        self,
        thresholds_gpu_s: Sequence[float] = TIRESIAS_THRESHOLDS_GPU_S,
        promote_knob: float = 0.0,
        free: bool = False,
    ) -> None:
        th = tuple(float(x) for x in thresholds_gpu_s)
        if any(x <= 0 for x in th) or list(th) != sorted(set(th)):
            raise ValueError(
                f"Tiresias thresholds must be positive and strictly increasing, not {th}"
            )
        if len(th) > _MAX_LEVEL:
            raise ValueError(f"at most {_MAX_LEVEL} thresholds")
        if promote_knob < 0:
            raise ValueError(f"promote_knob must be >= 0, not {promote_knob}")
        self.thresholds = th
        self.promote_knob = float(promote_knob)
        self._svc: dict[str, _Service] = {}
        self.promotions = 0
        super().__init__(
            config=SchedulerConfig(
                preemption=True, backfill=False,
                max_failed_preemption_searches=256 if free else 16,
            ),
            preemption=LowestPriorityVictims() if free else None,
            name="tiresias-free" if free else "tiresias",
        )
        self.ordering = _LevelFifo(self.entered)
        if free:
            self.checkpoint_model = FREE_PREEMPTION

    # ------------------------------------------------------------ bookkeeping
    def _service(self, w: Workload) -> _Service:
        s = self._svc.get(w.id)
        if s is None:
            s = self._svc[w.id] = _Service()
        hist = w.history
        for tr in hist[s.seen :]:
            t, target = tr.time, tr.target
            if target in _RUNNING:
                if s.running_since is None and target is State.RUNNING:
                    s.running_since = t
            elif s.running_since is not None:
                s.executed_s += t - s.running_since
                s.running_since = None
            if target in QUEUED and s.executed_s > s.base_executed_s:
                if s.waiting_since is None:
                    s.waiting_since = t
            elif s.waiting_since is not None:
                s.waited_s += t - s.waiting_since
                s.waiting_since = None
        s.seen = len(hist)
        return s

    def forget(self, wid: str) -> None:
        self._svc.pop(wid, None)

    def executed(self, w: Workload, now: float) -> float:
        """Seconds the job has run, over all attempts (RUNNING and PREEMPTING time)."""
        s = self._service(w)
        return s.executed_s + (now - s.running_since if s.running_since is not None else 0.0)

    def attained_gpu_s(self, w: Workload, now: float) -> float:
        """GPUs x executed seconds since the last starvation promotion (all attempts)."""
        s = self._service(w)
        return w.gpus() * (self.executed(w, now) - s.base_executed_s)

    def _waited(self, s: _Service, now: float) -> float:
        cur = now - s.waiting_since if s.waiting_since is not None else 0.0
        return s.waited_s + cur - s.base_waited_s

    def _queue_of(self, attained: float) -> int:
        # a hair of slack so that a wakeup computed for the crossing demotes at it
        eps = 1e-9 * max(1.0, attained)
        return sum(1 for th in self.thresholds if attained + eps >= th)

    # ----------------------------------------------------------------- levels
    def level(self, w: Workload, now: float) -> int:
        s = self._service(w)
        q = self._queue_of(self.attained_gpu_s(w, now))
        if q and self.promote_knob and s.waiting_since is not None:
            run = s.executed_s - s.base_executed_s
            waited = self._waited(s, now)
            if waited + 1e-9 * max(1.0, waited) >= self.promote_knob * run:
                # STARVELIMIT: back to the top queue; attained service counts from here
                s.base_executed_s = s.executed_s
                s.base_waited_s = s.waited_s
                s.waiting_since = None  # waiting counts again only after it has run
                self.promotions += 1
                q = 0
        return q

    def next_change(self, w: Workload, now: float) -> float | None:
        s = self._service(w)
        if s.running_since is not None:
            g = w.gpus()
            attained = self.attained_gpu_s(w, now)
            q = self._queue_of(attained)
            if g <= 0 or q >= len(self.thresholds):
                return None  # no GPUs: attains no GPU-seconds; or already in the last queue
            return now + (self.thresholds[q] - attained) / g
        if self.promote_knob and s.waiting_since is not None:
            if self._queue_of(self.attained_gpu_s(w, now)) == 0:
                return None
            run = s.executed_s - s.base_executed_s
            return now + max(0.0, self.promote_knob * run - self._waited(s, now))
        return None

    def reason(self, level: int) -> str:
        return f"tiresias: queue {level} of {len(self.thresholds) + 1}"

    def next_wakeup(self, cp: ControlPlane) -> float | None:
        """The next moment a live job changes queue by time alone: a running job
        crosses a threshold, or (with ``promote_knob``) a waiting one starves."""
        return self._next_due(cp)


# ---------------------------------------------------------------- factories
def mlwe_default(durations: Mapping[str, float]) -> Scheduler:
    """mlwe's default: run times learned online from completed jobs only (never true
    durations; mlwe.core.estimator), size-aware within a priority: feasible urgent
    deadlines first by slack, then the Gittins index of the learned service
    distribution per GPU (LAS where no history exists), aged so nothing starves,
    then arrival (mlwe.core.policies.ordering.SizeAware); preemption among equals when the
    expected gain exceeds the cost (see SchedulerConfig.gain_*); best fit;
    cheapest minimal preemption of strictly lower priorities; EASY backfill whose
    reservation lets through work expected (by user or learned estimate) to end
    before it."""
    return default_scheduler(name="mlwe")


def mlwe_drain(durations: Mapping[str, float]) -> Scheduler:
    """mlwe's default, and where no victim set is cheap to evict all at once for a
    one-replica job that would gain, a drain plan (SchedulerConfig.gain_drain): each
    victim evicted just after its own next checkpoint, the node held for the
    preemptor meanwhile, taken only if the expected gain exceeds the restores, the
    work lost by victims evicted at once and the GPU-seconds held idle
    (mlwe.core.gain.DrainPlan). Not the default: on eight Philly windows
    (benchmarks/policy_windows.py) its avg JCT is 1.4% above the default's
    (geometric mean) and its p99 bounded slowdown 2.5x (a held node keeps short
    jobs off its other GPUs)."""
    sched = default_scheduler(name="mlwe-drain")
    sched.config = replace(sched.config, gain_drain=True)
    return sched


def mlwe_rewait(durations: Mapping[str, float]) -> Scheduler:
    """mlwe's default, and a victim of preemption among equals counted as delayed
    by the longer of its preemptor's run and its own wait to be placed again: the
    90th percentile of the waits that evicted jobs of its priority and saved
    service (powers of two of GPU-seconds) had before they were placed again,
    learned from the restarts seen so far (SchedulerConfig.gain_rewait_quantile,
    mlwe.core.gain.Rewaits). Not the default: over 8 jittered replicas
    (benchmarks/policy_noise.py) it moved philly-3000's p99 JCT from 1.043 to
    1.032 x fifo-backfill's (median) and left philly-5000's and both average
    JCTs within the noise, but it raised itp:05's average JCT from 142,355 s to
    169,946 s, over edf's 147,055 s, and over eight Philly windows
    (benchmarks/policy_windows.py) its average JCT is 1.068 x the default's
    (geometric mean) and its p99 1.013 x (README: the p99 anatomy)."""
    sched = default_scheduler(name="mlwe-rewait")
    sched.config = replace(sched.config, gain_rewait_quantile=0.9)
    return sched


def fifo_strict(durations: Mapping[str, float]) -> Scheduler:
    """Strict FIFO: jobs start in arrival order; the first that does not fit blocks
    every later one. No preemption."""
    return Scheduler(
        ordering=_Fifo(), config=SchedulerConfig(preemption=False, backfill=False, strict_order=True),
        name="fifo",
    )


def fifo_backfill(durations: Mapping[str, float]) -> Scheduler:
    """FIFO with backfill: arrival order, and any later job that fits may start when
    an earlier one does not (no reservation). No preemption."""
    return Scheduler(
        ordering=_Fifo(), config=SchedulerConfig(preemption=False, backfill=False),
        name="fifo-backfill",
    )


def sjf_oracle(durations: Mapping[str, float]) -> Scheduler:
    """SJF (oracle durations): queued jobs in order of TRUE total duration (known only
    to the simulator), shortest first, arrival breaking ties; greedy backfill (a later
    job that fits may start when an earlier one does not; no reservation).
    Non-preemptive. Ignores user estimates and priorities."""
    return Scheduler(
        ordering=_OracleShortestFirst(durations),
        config=SchedulerConfig(preemption=False, backfill=False),
        name="sjf",
    )


def srtf_oracle(durations: Mapping[str, float]) -> Scheduler:
    """SRTF (oracle remaining time, power-of-two levels), preemptive: remaining =
    TRUE duration minus work done as the control plane counts it (checkpointed work,
    plus time running in the current attempt after its restart cost; checkpoint
    pauses are not subtracted). Level = ceil(log2(remaining s)), 0 at or below 1 s,
    so (2^(k-1), 2^k] s is level k; prepare() sets effective priority 1000 - level
    (SetPriority) for every queued and running job before each cycle. A queued job
    of level k preempts running jobs of level > k, i.e. with more than 2^k s left
    (the core's cheapest minimal victim set among them; victims resume from their
    last checkpoint); within a level nobody is preempted. Queue order: level, then
    exact remaining time, then arrival; greedy backfill. Ignores user estimates and
    static priorities."""
    return OracleSrtf(durations)


def srtf_free(durations: Mapping[str, float]) -> Scheduler:
    """SRTF as the Tiresias authors' simulator runs it (``shortest``; oracle
    remaining time), with free, instant preemption: remaining = TRUE duration minus
    the work done; effective priority 100,000 - level with level =
    int(1000 x log2(1 + remaining s)), i.e. remaining time to 0.07%, recomputed
    before each cycle for every running job ranked below a waiting one
    (SetPriority). A queued job preempts any
    running job with more remaining time; the victims are the running jobs with the
    most remaining time (last in the order), as the authors' simulator evicts the
    jobs that fall out of the greedy allocation. Always runs under the "free"
    checkpoint model whatever the replay's setting: no work lost, no eviction
    delay, no restore cost. Queue order: remaining time, then arrival; greedy
    backfill. Ignores user estimates and static priorities."""
    return OracleSrtf(durations, exact=True)


def tiresias(
    durations: Mapping[str, float],
    *,
    thresholds_gpu_s: Sequence[float] = TIRESIAS_THRESHOLDS_GPU_S,
    promote_knob: float = 0.0,
) -> Scheduler:
    """Tiresias discretised 2D-LAS (NSDI'19), no duration knowledge: attained service
    = GPUs x executed seconds (time RUNNING or PREEMPTING, summed over all attempts).
    K = len(thresholds)+1 queues; default thresholds 3250 and 7200 GPU-s (3 queues,
    as the authors' public simulator), configurable with thresholds_gpu_s=. A job enters queue 0 and moves down one queue each time its
    attained service crosses a threshold, at that exact moment (the policy asks the
    simulator for a wakeup then); prepare() sets effective priority 1000 - queue
    (SetPriority). A queued job preempts running jobs in later (lower-priority)
    queues (the core's cheapest minimal victim set; victims checkpoint and resume
    from their last checkpoint under the replay's checkpoint model); within a
    queue, FIFO by the time the job entered it (arrival, or demotion) and no
    preemption; greedy backfill. Starvation promotion
    (STARVELIMIT) is OFF by default, as in the authors' simulator; promote_knob=k > 0
    moves a waiting job back to queue 0 once the time it has waited, after running
    since its last promotion, reaches k x the time it ran since then; its attained
    service then restarts from 0. Ignores user estimates and static priorities."""
    return Tiresias(thresholds_gpu_s=thresholds_gpu_s, promote_knob=promote_knob)


def tiresias_free(
    durations: Mapping[str, float],
    *,
    thresholds_gpu_s: Sequence[float] = TIRESIAS_THRESHOLDS_GPU_S,
    promote_knob: float = 0.0,
) -> Scheduler:
    """Tiresias as its authors simulate it (SymbioticLab/Tiresias ``dlas-gpu``):
    the same discretised 2D-LAS as "tiresias" (3 queues, thresholds 3250 and 7200
    GPU-s, FIFO by queue entry within a queue, greedy backfill, no duration
    knowledge) but with free, instant preemption: it always runs under the "free"
    checkpoint model whatever the replay's setting (no work lost, no eviction
    delay, no restore cost), and the victims are the running jobs last in the
    order (latest queue, then latest arrival), as the authors' simulator evicts the
    jobs that fall out of its greedy allocation. For reproducing the authors'
    figures; compare mlwe with the checkpoint-costed "tiresias"."""
    return Tiresias(thresholds_gpu_s=thresholds_gpu_s, promote_knob=promote_knob, free=True)


def edf(durations: Mapping[str, float]) -> Scheduler:
    """EDF: queued jobs in order of absolute deadline, earliest first; jobs without
    a deadline after every job with one; arrival breaks ties (FIFO among jobs
    without a deadline). Greedy backfill (no reservation). Non-preemptive. Ignores
    durations, user estimates and priorities."""
    return Scheduler(
        ordering=_EarliestDeadline(),
        config=SchedulerConfig(preemption=False, backfill=False),
        name="edf",
    )


def strict_priority(durations: Mapping[str, float]) -> Scheduler:
    """Strict priority without preemption: queued jobs in order of static (spec)
    priority, highest first, then arrival; greedy backfill (a lower-priority job
    that fits may start while a higher one waits; no reservation). A running job
    is never preempted. Ignores durations, deadlines and user estimates."""
    return Scheduler(
        ordering=_StaticPriority(),
        config=SchedulerConfig(preemption=False, backfill=False),
        name="priority",
    )


PolicyFactory = Callable[..., Scheduler]

#: Registered explicitly; the first entry ("mlwe") is the default policy.
POLICIES: dict[str, PolicyFactory] = {
    "mlwe": mlwe_default,
    "mlwe-drain": mlwe_drain,
    "mlwe-rewait": mlwe_rewait,
    "fifo": fifo_strict,
    "fifo-backfill": fifo_backfill,
    "sjf": sjf_oracle,
    "srtf": srtf_oracle,
    "srtf-free": srtf_free,
    "tiresias": tiresias,
    "tiresias-free": tiresias_free,
    "edf": edf,
    "priority": strict_priority,
}

#: Policies that read the true durations (oracles, labelled so in their semantics).
ORACLE_POLICIES: frozenset[str] = frozenset({"sjf", "srtf", "srtf-free"})

#: Where each policy puts a job's replicas (the same placement plug-in for all of
#: them: on a pooled cluster it makes no difference; on nodes it is not the
#: first-fit of some peers' simulators, which explains their differences there).
POLICY_PLACEMENT: dict[str, str] = {
    name: "best-fit (node with the fewest whole GPUs left free; mlwe.core BestFit)"
    for name in POLICIES
}

POLICY_SEMANTICS: dict[str, str] = {name: (f.__doc__ or "").strip() for name, f in POLICIES.items()}


def make_policy(name: str, durations: Mapping[str, float], **options: Any) -> Scheduler:
    """A fresh scheduler for policy ``name``; ``options`` go to its factory
    (e.g. ``thresholds_gpu_s`` and ``promote_knob`` for "tiresias")."""
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown policy {name!r}; known: {', '.join(POLICIES)}") from None
    return factory(durations, **options)
