"""The simulated backend: the Backend protocol on simulated time.

It models what a real cluster does to a workload, from the workload's TRUE
duration (known here, never to the scheduler):
- start latency, then run time; on a resumed attempt, the restart cost first;
- periodic checkpoints every ``checkpoint_interval`` seconds of work, each
  taking ``checkpoint_cost`` seconds; a stop loses the work since the last one;
- graceful eviction: a stop request releases the resources after
  ``eviction_delay_s`` (at most the grace period): the time a real process
  takes to handle SIGTERM and exit;
- injected failures: job crashes (seeded per attempt) and node failures with
  recoveries;
- optional synthetic telemetry: utilisation, VRAM, power, and a loss curve per
  training workload.
Commands are idempotent by request id; every event has a unique id.

Run models (a world with a ground truth, a forecast playing hazards) extend it
through public hooks only: :meth:`SimBackend.on_start`, :meth:`~SimBackend.on_finish`,
:meth:`~SimBackend.on_release` and :meth:`~SimBackend.sample_metrics` are called
at fixed points of a run's life, and :meth:`~SimBackend.current`,
:meth:`~SimBackend.run_of`, :meth:`~SimBackend.take_over`,
:meth:`~SimBackend.finish_at`, :meth:`~SimBackend.crash`,
:meth:`~SimBackend.end_run`, :meth:`~SimBackend.emit`, :meth:`~SimBackend.is_down`
and :attr:`~SimBackend.rng` are what they may use.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mlwe.core.actions import Exited, Released, Started
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
from mlwe.core.spec import WorkloadKind, WorkloadSpec
from mlwe.sim.kernel import Kernel


@dataclass(slots=True)
class SimRun:
    """One attempt of a workload on the simulator (what a run model reads)."""

    workload: str
    attempt: int
    spec: WorkloadSpec
    nodes: tuple[str, ...]
    t_start: float  # when the process started (after start latency)
    overhead: float  # restart cost paid before useful work
    base_work: float  # true work saved before this attempt
    finished: bool = False


_Run = SimRun  # the former private name


@dataclass
class SimBackendConfig:
    start_latency_s: float = 0.0
    eviction_delay_s: float = 5.0
    failure_prob: float = 0.0  # per attempt
    telemetry_interval_s: float | None = None
    seed: int = 0
    #: the "free" checkpoint model: a stop loses no work and releases at once
    free_preemption: bool = False
    #: a workload that checkpoints (``checkpoint_interval`` set) saves its state on
    #: the stop signal, within the grace period: a graceful stop then loses no work
    #: (off: the work since its last periodic checkpoint is lost)
    checkpoint_on_signal: bool = False


@dataclass
class SimBackend:
    kernel: Kernel
    durations: Mapping[str, float]  # true run time per workload id
    config: SimBackendConfig = field(default_factory=SimBackendConfig)
    name: str = "sim"

    def __post_init__(self) -> None:
        self._out: list[Event] = []
        self._seen: set[str] = set()
        self._runs: dict[str, SimRun] = {}  # workload -> current run
        self.saved: dict[str, float] = {}  # workload -> true work saved in checkpoints
        self.lost_gpu_s = 0.0  # GPU-seconds of work lost to stops and failures
        self.telemetry: list[Telemetry] = []
        self._n = 0
        self._rng = random.Random(self.config.seed)
        self._down: set[str] = set()

    # ------------------------------------------------------------------ protocol
    def send(self, commands: Sequence[Command]) -> None:
        dispatch(commands, self._seen, self._start, self._stop)

    def poll(self) -> list[Event]:
        out, self._out = self._out, []
        return out

    def drain_telemetry(self) -> list[Telemetry]:
        out, self.telemetry = self.telemetry, []
        return out

    def inventory(self) -> list[RunningAttempt]:
        return [
            RunningAttempt(r.workload, r.attempt, r.nodes)
            for r in self._runs.values()
            if not r.finished
        ]

    def close(self) -> None:
        for run in list(self._runs.values()):
            if not run.finished:
                self._end(run)

    # ------------------------------------------------------- run-model hooks
    # Called by the simulator at fixed points of a run's life; the defaults do
    # nothing. A subclass overrides these (and only these) to model more.
    def on_start(self, c: StartCommand) -> None:
        """After a start command was handled (the run may have been lost at once to a
        down node: :meth:`run_of` then does not hold an unfinished run of ``c.attempt``)."""

    def on_finish(self, workload: str, attempt: int) -> bool:
        """When a run's natural end comes due, before it is checked to still be
        current; return False to ignore it (a run that hangs)."""
        return True

    def on_release(self, workload: str, attempt: int) -> None:
        """When a graceful stop's release comes due (the eviction delay has passed),
        before it is checked to still be current."""

    def sample_metrics(self, run: SimRun, now: float) -> dict[str, float]:
        """What one telemetry sample of a running workload reports."""
        spec = run.spec
        rng = self._rng
        gpus = spec.resources.gpu / 1000
        util = 0.0 if not gpus else min(1.0, 0.55 + 0.4 * rng.random())
        metrics = {
            "gpu_util": util,
            "gpu_power_w": 70 + 330 * util if gpus else 0.0,
            "cpu_util": 0.3 + 0.6 * rng.random(),
        }
        if spec.kind in (WorkloadKind.TRAINING, WorkloadKind.FINE_TUNE):
            work = run.base_work + max(0.0, now - run.t_start - run.overhead)
            frac = work / max(1.0, self.durations[run.workload])
            metrics["loss"] = 2.5 * math.exp(-3.0 * frac) + 0.1 + 0.02 * rng.random()
        return metrics

    # ------------------------------------------------------- run-model tools
    @property
    def rng(self) -> random.Random:
        """The backend's seeded random stream (crashes and telemetry draw from it)."""
        return self._rng

    def current(self, workload: str, attempt: int) -> SimRun | None:
        """The run of ``workload``'s ``attempt`` if it is still going, else None."""
        return self._current(workload, attempt)

    def run_of(self, workload: str) -> SimRun | None:
        """The latest run of ``workload``, finished or not (None: never run here)."""
        return self._runs.get(workload)

    def is_down(self, node: str) -> bool:
        return node in self._down

    def emit(self, fact: Fact) -> None:
        """Report ``fact`` now (the next :meth:`poll` returns it)."""
        self._emit(fact)

    def end_run(self, run: SimRun) -> float:
        """Stop ``run``'s clock: returns the true work saved, counts the work lost."""
        return self._end(run)

    def crash(self, workload: str, attempt: int, code: int, cause: str = "error") -> bool:
        """Crash the attempt now if it is still going (an ``Exited`` with ``code`` and
        ``cause``); False if it was not."""
        run = self._current(workload, attempt)
        if run is None:
            return False
        self._end(run)
        self._emit(Exited(workload, attempt, code, cause))
        return True

    def finish_at(self, t: float, workload: str, attempt: int) -> None:
        """Schedule the attempt's natural end (success) at ``t``."""
        self.kernel.at(t, self._finish, (workload, attempt))

    def take_over(self, workload: str, attempt: int, spec: WorkloadSpec, nodes: tuple[str, ...],
                  t_start: float, overhead: float, base_work: float, *,
                  confirm_start: bool = False) -> SimRun:
        """Hold a run already in progress elsewhere (a forecast's fork of live state).
        Nothing is scheduled for its end: the caller does that (:meth:`finish_at`).
        ``confirm_start``: report it ``Started`` now (it was still starting)."""
        run = SimRun(workload, attempt, spec, nodes, t_start, overhead, base_work)
        self._runs[workload] = run
        if confirm_start:
            k = self.kernel
            k.at(k.clock.t, self._emit_cb, Started(workload, attempt))
        return run

    # ------------------------------------------------------------------ events
    def _emit(self, fact: Fact) -> None:
        self._n += 1
        self._out.append(Event(f"sim-{self._n}", self.kernel.clock.t, fact))

    def _emit_cb(self, fact: Fact) -> None:
        self._emit(fact)

    # ------------------------------------------------------------------- start
    def _start(self, c: StartCommand) -> None:
        k = self.kernel
        now = k.clock.t
        spec = c.spec
        base = self.saved.get(c.workload, 0.0)
        overhead = spec.restart_cost if base > 0 else 0.0
        run = _Run(
            c.workload, c.attempt, spec, tuple(a.node for a in c.placement),
            now + self.config.start_latency_s, overhead, base,
        )
        if any(n in self._down for n in run.nodes):
            k.at(now, self._emit_cb, Exited(c.workload, c.attempt, -1, "node-lost"))
            self.on_start(c)
            return
        self._runs[c.workload] = run
        k.at(run.t_start, self._emit_cb, Started(c.workload, c.attempt))
        remaining = max(0.0, self.durations[c.workload] - base)
        wall = overhead + remaining + self._checkpoint_time(spec, remaining)
        if self.config.failure_prob and self._rng.random() < self.config.failure_prob:
            t_fail = run.t_start + self._rng.random() * wall
            k.at(t_fail, self._crash, (c.workload, c.attempt, 1))
        else:
            k.at(run.t_start + wall, self._finish, (c.workload, c.attempt))
        if self.config.telemetry_interval_s:
            k.at(run.t_start, self._sample, (c.workload, c.attempt))
        self.on_start(c)

    @staticmethod
    def _checkpoint_time(spec: WorkloadSpec, work: float) -> float:
        iv = spec.checkpoint_interval
        if not iv or not spec.checkpoint_cost:
            return 0.0
        return math.floor(work / iv) * spec.checkpoint_cost

    def _current(self, wid: str, attempt: int) -> SimRun | None:
        run = self._runs.get(wid)
        if run is None or run.attempt != attempt or run.finished:
            return None
        return run

    def _finish(self, arg: tuple[str, int]) -> None:
        if not self.on_finish(*arg):
            return
        run = self._current(*arg)
        if run is None:
            return
        run.finished = True
        self.saved[run.workload] = self.durations[run.workload]
        self._emit(Exited(run.workload, run.attempt, 0))

    def _crash(self, arg: tuple[str, int, int]) -> None:
        self.crash(*arg)

    def _work_saved(self, run: SimRun, now: float) -> float:
        """True work that survives stopping ``run`` now (periodic checkpoints only)."""
        spec = run.spec
        elapsed = max(0.0, now - run.t_start - run.overhead)
        if self.config.free_preemption:
            return min(self.durations[run.workload], run.base_work + elapsed)
        iv = spec.checkpoint_interval
        if not iv:
            return run.base_work
        n = math.floor(elapsed / (iv + spec.checkpoint_cost))
        return min(self.durations[run.workload], run.base_work + n * iv)

    def _end(self, run: SimRun) -> float:
        """Stop the run's clock; returns true work saved and counts the lost work."""
        now = self.kernel.clock.t
        run.finished = True
        saved = self._work_saved(run, now)
        done = run.base_work + max(0.0, now - run.t_start - run.overhead)
        gpus = run.spec.resources.gpu * run.spec.replicas / 1000
        self.lost_gpu_s += gpus * max(0.0, min(done, self.durations[run.workload]) - saved)
        self.saved[run.workload] = saved
        return saved

    # -------------------------------------------------------------------- stop
    def _stop(self, c: StopCommand) -> None:
        k = self.kernel
        run = self._current(c.workload, c.attempt)
        if run is None:
            # never started here, or already gone: nothing holds the resources
            k.at(k.clock.t, self._emit_cb, Released(c.workload, c.attempt))
            return
        delay = 0.0 if self.config.free_preemption else min(self.config.eviction_delay_s, c.grace_s)
        k.at(k.clock.t + delay, self._release, (c.workload, c.attempt))

    def _release(self, arg: tuple[str, int]) -> None:
        self.on_release(*arg)
        if self.config.checkpoint_on_signal and self._release_on_signal(arg):
            return
        run = self._current(*arg)
        if run is None:
            return  # it finished or crashed inside the grace period
        saved = self._end(run)
        est = run.spec.estimated_duration
        frac = min(1.0, saved / est) if est else None
        # under free preemption the backend says how much work survives (the core
        # cannot derive it from a checkpoint interval)
        work = saved if self.config.free_preemption else None
        self._emit(
            Released(run.workload, run.attempt, checkpointed_progress=frac, checkpointed_work_s=work)
        )

    def _release_on_signal(self, arg: tuple[str, int]) -> bool:
        """A graceful stop of a workload that checkpoints: it saves its state on the
        signal, so no work is lost. False when it does not checkpoint (or is gone)."""
        run = self._current(*arg)
        if run is None or not run.spec.checkpoint_interval:
            return False
        now = self.kernel.clock.t
        total = self.durations[run.workload]
        done = min(total, run.base_work + max(0.0, now - run.t_start - run.overhead))
        run.finished = True
        self.saved[run.workload] = done
        est = run.spec.estimated_duration
        frac = min(1.0, done / est) if est else None
        self._emit(Released(run.workload, run.attempt, checkpointed_progress=frac))
        return True

    # -------------------------------------------------------------- node faults
    def fail_node(self, t: float, node: str, down_for: float | None = None) -> None:
        """Inject a node failure at ``t`` (and a recovery ``down_for`` later)."""
        self.kernel.at(t, self._node_down, node)
        if down_for is not None:
            self.kernel.at(t + down_for, self._node_up, node)

    def _node_down(self, node: str) -> None:
        self._down.add(node)
        for run in list(self._runs.values()):
            if not run.finished and node in run.nodes:
                self._end(run)  # the core turns the node loss into node-lost exits
        self._emit(NodeDown(node, "injected failure"))

    def _node_up(self, node: str) -> None:
        self._down.discard(node)
        self._emit(NodeUp(node))

    # --------------------------------------------------------------- telemetry
    def _sample(self, arg: tuple[str, int]) -> None:
        run = self._current(*arg)
        if run is None:
            return
        now = self.kernel.clock.t
        metrics = self.sample_metrics(run, now)
        for node in dict.fromkeys(run.nodes):
            self.telemetry.append(Telemetry(now, node, run.workload, metrics))
        iv = self.config.telemetry_interval_s
        if iv:
            self.kernel.at(now + iv, self._sample, arg)
