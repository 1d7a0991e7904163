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
class _Run:
    workload: str
    attempt: int
    spec: WorkloadSpec
    nodes: tuple[str, ...]
    t_start: float  # when the process started (after start latency)
    overhead: float  # restart cost paid before useful work
    base_work: float  # true work saved before this attempt
    finished: bool = False


@dataclass
class SimBackendConfig:
    start_latency_s: float = 0.0
    eviction_delay_s: float = 5.0
    failure_prob: float = 0.0  # per attempt
    telemetry_interval_s: float | None = None
    seed: int = 0
    #: the "free" checkpoint model: a stop loses no work and releases at once
    free_preemption: bool = False


@dataclass
class SimBackend:
    kernel: Kernel
    durations: Mapping[str, float]  # true run time per workload id
    config: SimBackendConfig = field(default_factory=SimBackendConfig)
    name: str = "sim"

    def __post_init__(self) -> None:
        self._out: list[Event] = []
        self._seen: set[str] = set()
        self._runs: dict[str, _Run] = {}  # workload -> current run
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

    @staticmethod
    def _checkpoint_time(spec: WorkloadSpec, work: float) -> float:
        iv = spec.checkpoint_interval
        if not iv or not spec.checkpoint_cost:
            return 0.0
        return math.floor(work / iv) * spec.checkpoint_cost

    def _current(self, wid: str, attempt: int) -> _Run | None:
        run = self._runs.get(wid)
        if run is None or run.attempt != attempt or run.finished:
            return None
        return run

    def _finish(self, arg: tuple[str, int]) -> None:
        run = self._current(*arg)
        if run is None:
            return
        run.finished = True
        self.saved[run.workload] = self.durations[run.workload]
        self._emit(Exited(run.workload, run.attempt, 0))

    def _crash(self, arg: tuple[str, int, int]) -> None:
        wid, attempt, code = arg
        run = self._current(wid, attempt)
        if run is None:
            return
        self._end(run)
        self._emit(Exited(wid, attempt, code, "error"))

    def _work_saved(self, run: _Run, now: float) -> float:
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

    def _end(self, run: _Run) -> float:
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
        metrics = self._metrics(run, now)
        for node in dict.fromkeys(run.nodes):
            self.telemetry.append(Telemetry(now, node, run.workload, metrics))
        iv = self.config.telemetry_interval_s
        if iv:
            self.kernel.at(now + iv, self._sample, arg)

    def _metrics(self, run: _Run, now: float) -> dict[str, float]:
        """What one sample of a running workload reports (subclasses model more)."""
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
