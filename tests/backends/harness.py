"""Backend harnesses for the conformance suite: one control plane, any backend.

Every harness drives the same loop the runtime Engine runs:
``events = backend.poll(); reconciler.handle(events); cmds = reconciler.step();
backend.send(cmds)``, checks the invariants after every iteration, and turns a
backend-neutral job description into the same ``WorkloadSpec`` (the command
runs ``mlwe.programs.synthetic``; the simulator ignores it and is told the
job's duration and crash instead).

To add a backend (e.g. Ray): subclass :class:`Harness`, implement ``_backend``,
``_advance``, ``lose_node`` and ``replicas_seen`` (and ``resumed_from`` if the
base's report-based version does not fit), and register it in ``HARNESSES``.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlwe.core import ClusterSpec, NodeSpec, State, WorkloadSpec
from mlwe.core.actions import Submit
from mlwe.core.backend import Backend, Command, StartCommand, Telemetry
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.sim.backend import SimBackend, SimBackendConfig
from mlwe.sim.kernel import Kernel

GRACE_S = 2.0  # the stop grace period the reconciler asks for
RETRY_BASE_S = 0.3
RETRY_FACTOR = 2.0


class MonotonicClock:
    """Wall time for the real backends (seconds from an arbitrary origin)."""

    def now(self) -> float:
        return time.monotonic()


#: how many times a scenario's timeout a real backend gets: real processes (Ray's
#: workers above all) start far slower on a loaded 2-core machine; once, under
#: .ci/loaded, Ray took over 60 s to start a crashing job's third attempt
REAL_PATIENCE = 4.0


class Harness:
    name = "base"
    real = False  # real processes (wall clock) or simulated time

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.sent: list[Command] = []
        self.resumed: dict[tuple[str, int], float] = {}
        self.seen_replicas: dict[str, set[int]] = {}
        self.telemetry: list[Telemetry] = []
        self.checks = 0
        self.cp: ControlPlane
        self.rec: Reconciler
        self.backend: Backend

    # ------------------------------------------------------------- to implement
    def _clock(self) -> Any:
        raise NotImplementedError

    def _backend(self, cluster: ClusterSpec) -> Backend:
        raise NotImplementedError

    def _advance(self, deadline: float) -> None:
        """Let time pass until something may have happened (at most until ``deadline``)."""
        raise NotImplementedError

    def lose_node(self, node: str) -> None:
        raise NotImplementedError

    def _job_registered(self, spec: WorkloadSpec, work_s: float, crash: tuple[float, int] | None
                        ) -> None:
        """A job was described (the simulator learns its duration and crash here)."""

    # ------------------------------------------------------------------- common
    def start(self, nodes: list[NodeSpec]) -> None:
        cluster = ClusterSpec(nodes=tuple(nodes))
        self.clock = self._clock()
        self.cp = build_control_plane(cluster, self.clock, check_invariants=True)
        self.rec = Reconciler(self.cp, Scheduler(), grace_s=GRACE_S, retry_base_s=RETRY_BASE_S,
                              retry_factor=RETRY_FACTOR, retry_max_s=5.0)
        self.backend = self._backend(cluster)

    def job(
        self,
        wid: str,
        *,
        work_s: float,
        priority: str | int = "normal",
        replicas: int = 1,
        cpu: str = "500m",
        memory: str = "64Mi",
        checkpoint_every: float | None = None,
        crash: tuple[float, int] | None = None,  # (at progress, exit code)
        max_retries: int = 3,
        hold_at: float | None = None,  # real programs wait there until release(wid)
    ) -> WorkloadSpec:
        cmd = ["python", "-m", "mlwe.programs.synthetic", "--work", str(work_s),
               "--memory", "8Mi", "--phases", "0.3:1", "--report-every", "0.1"]
        if hold_at is not None:
            cmd += ["--hold-at", str(hold_at), "--hold-file", str(self._release_file(wid))]
        if checkpoint_every:
            cmd += ["--checkpoint-every", str(checkpoint_every)]
        if crash is not None:
            cmd += ["--mode", "crash", "--at", str(crash[0]), "--exit-code", str(crash[1])]
        spec = WorkloadSpec.model_validate({
            "id": wid, "name": wid, "priority": priority, "replicas": replicas,
            "resources": {"cpu": cpu, "memory": memory},
            "estimated_duration": work_s, "max_retries": max_retries,
            **({"checkpoint_interval": checkpoint_every} if checkpoint_every else {}),
            "command": cmd,
        })
        self._job_registered(spec, work_s, crash)
        return spec

    def _release_file(self, wid: str) -> Path:
        return self.tmp / f"release-{wid}"

    def release(self, wid: str) -> None:
        """Let the programs of ``wid`` held at their ``hold_at`` go on (a no-op where
        time is simulated: there nothing happens between two steps)."""
        self._release_file(wid).touch()

    def submit(self, *specs: WorkloadSpec) -> None:
        result = self.cp.apply([Submit(s) for s in specs], cause_id="test")
        assert result.accepted, result.reasons()

    def step(self) -> None:
        self.rec.handle(self.backend.poll())
        while True:
            commands = self.rec.step()
            if not commands:
                break
            for c in commands:
                if isinstance(c, StartCommand):
                    self._on_start(c)
            self.sent += commands
            self.backend.send(commands)
            self.rec.handle(self.backend.poll())
        for t in self.backend.drain_telemetry():
            self.telemetry.append(t)
            m = t.metrics
            if t.workload is not None and "replica" in m:
                self.seen_replicas.setdefault(t.workload, set()).add(int(m["replica"]))
                if "resumed_from" in m:
                    self.resumed[(t.workload, int(m["attempt"]))] = m["resumed_from"]
        problems = self.cp.validate_state()
        assert problems == [], problems
        self.checks += 1

    def _on_start(self, c: StartCommand) -> None:
        pass

    def run_until(self, pred: Callable[[], bool], *, timeout: float, what: str) -> None:
        """Drive the loop until ``pred()`` holds; fail after ``timeout`` seconds (on a
        real backend, :data:`REAL_PATIENCE` times that: a bound on a busy machine,
        not a wait, since a passing run returns as soon as the condition holds)."""
        if self.real:
            timeout *= REAL_PATIENCE
        deadline = self.clock.now() + timeout
        while True:
            self.step()
            if pred():
                return
            if self.clock.now() >= deadline:
                states = {w.id: (w.state.value, w.attempt, w.failure_cause)
                          for w in self.cp.workloads.values()}
                raise AssertionError(f"{self.name}: timed out after {timeout}s waiting for {what};"
                                     f" workloads: {states}; rejected: {self.rejected()}")
            self._advance(deadline)

    def run_for(self, seconds: float) -> None:
        """Drive the loop while ``seconds`` of (wall or simulated) time pass."""
        end = self.clock.now() + seconds
        while True:
            self.step()
            if self.clock.now() >= end:
                return
            self._advance(end)

    def state(self, wid: str) -> State:
        return self.cp.get(wid).state

    def starts(self, wid: str) -> list[StartCommand]:
        return [c for c in self.sent if isinstance(c, StartCommand) and c.workload == wid]

    def progress(self, wid: str) -> float:
        """How far the workload's current run got, as the control plane knows it."""
        return self.cp.get(wid).progress

    def resumed_from(self, wid: str, attempt: int) -> float | None:
        """The progress the workload's attempt resumed from, as the workload itself saw it."""
        return self.resumed.get((wid, attempt))

    def metrics(self, wid: str | None, node: str | None = None) -> list[Telemetry]:
        """Telemetry samples about a workload (or, with ``wid=None``, about a node)."""
        return [t for t in self.telemetry
                if t.workload == wid and (node is None or t.node == node)]

    def replicas_seen(self, wid: str) -> set[int]:
        """Replica indices that really ran."""
        return self.seen_replicas.get(wid, set())

    def rejected(self) -> list[str]:
        return [r for res in self.rec.rejected for r in res.reasons()]

    def close(self) -> None:
        if hasattr(self, "backend"):
            self.backend.close()


# ------------------------------------------------------------------- simulator
class _ScriptedSimBackend(SimBackend):
    """The simulator with per-job crashes (the stock one draws crashes at random)."""

    crashes: dict[str, tuple[float, int]]

    def on_start(self, c: StartCommand) -> None:
        run = self.run_of(c.workload)
        crash = self.crashes.get(c.workload)
        if crash is not None and run is not None and run.attempt == c.attempt:
            at, code = crash
            self.kernel.at(run.t_start + at * self.durations[c.workload], self._scripted_crash,
                           (c.workload, c.attempt, code))

    def _scripted_crash(self, arg: tuple[str, int, int]) -> None:
        self.crash(*arg)


class SimHarness(Harness):
    name = "sim"

    def __init__(self, tmp: Path) -> None:
        super().__init__(tmp)
        self.kernel = Kernel()
        self.durations: dict[str, float] = {}
        self.crashes: dict[str, tuple[float, int]] = {}
        self._wakeups: set[float] = set()

    def _clock(self) -> Any:
        return self.kernel.clock

    def _backend(self, cluster: ClusterSpec) -> Backend:
        b = _ScriptedSimBackend(self.kernel, self.durations,
                                SimBackendConfig(eviction_delay_s=0.05))
        b.crashes = self.crashes
        return b

    def _job_registered(self, spec: WorkloadSpec, work_s: float, crash: tuple[float, int] | None
                        ) -> None:
        assert spec.id is not None
        self.durations[spec.id] = work_s
        if crash is not None:
            self.crashes[spec.id] = crash

    def _on_start(self, c: StartCommand) -> None:
        assert isinstance(self.backend, SimBackend)
        saved = self.backend.saved.get(c.workload, 0.0)
        self.resumed[(c.workload, c.attempt)] = saved / self.durations[c.workload]
        self.seen_replicas.setdefault(c.workload, set()).update(range(len(c.placement)))

    def progress(self, wid: str) -> float:
        # the simulator reports no progress; what its run has done is known here
        assert isinstance(self.backend, SimBackend)
        run = self.backend.run_of(wid)
        if run is None or run.finished:
            return self.cp.get(wid).progress
        done = run.base_work + max(0.0, self.kernel.clock.t - run.t_start - run.overhead)
        return min(1.0, done / self.durations[wid])

    def _advance(self, deadline: float) -> None:
        # at most 0.1 s at a time, so conditions on progress are seen as they become true
        nxt = min(self.kernel.peek(), self.rec.next_wakeup() or math.inf, deadline,
                  self.kernel.clock.t + 0.1)
        if nxt not in self._wakeups and nxt != self.kernel.peek():
            self._wakeups.add(nxt)
            self.kernel.at(nxt, lambda _: None)  # a retry or the deadline is due then
        self.kernel.run(until=nxt)

    def lose_node(self, node: str) -> None:
        assert isinstance(self.backend, SimBackend)
        self.backend.fail_node(self.kernel.clock.t, node)


# ----------------------------------------------------------------------- local
class LocalHarness(Harness):
    """Real daemons (one process per node) running real synthetic workloads."""

    name = "local"
    real = True
    #: which nodes each daemon serves (default: one daemon per node)
    daemon_groups: list[list[str]] | None = None
    declared_gpus = False
    telemetry_s = 0.5

    def _clock(self) -> Any:
        return MonotonicClock()

    def _backend(self, cluster: ClusterSpec) -> Backend:
        from mlwe.backends.local import LocalBackend

        # a 2 s heartbeat window: CI machines are busy, and a late heartbeat must not
        # read as a lost node
        b = LocalBackend(cluster, heartbeat_s=0.25, missed_heartbeats=8,
                         telemetry_s=self.telemetry_s, report_s=0.1, register_timeout_s=30,
                         checkpoint_root=self.tmp / "ckpt", work_dir=self.tmp, clock=self.clock)
        self.local = b
        specs = {n.name: n for n in cluster.nodes}
        groups = self.daemon_groups or [[n] for n in specs]
        self.daemons: dict[str, subprocess.Popen[bytes]] = {}
        for group in groups:
            proc = b.spawn_daemon([specs[n] for n in group], declared_gpus=self.declared_gpus)
            self.daemons.update(dict.fromkeys(group, proc))
        b.wait_for_nodes(timeout=30)
        return b

    def _advance(self, deadline: float) -> None:
        self.local.wait(max(0.0, min(0.02, deadline - self.clock.now())))

    def lose_node(self, node: str) -> None:
        # the machine's daemon dies at once; its workloads die with it (PDEATHSIG)
        os.kill(self.daemons[node].pid, signal.SIGKILL)
        self.daemons[node].wait()


HARNESSES: dict[str, type[Harness]] = {"sim": SimHarness, "local": LocalHarness}


# the Ray backend's harness lives in its own module (it subclasses Harness, defined above)
from tests.backends.ray_harness import RayHarness  # noqa: E402

HARNESSES["ray"] = RayHarness

# the Slurm backend's harness: a real Slurm cluster started by the test process
from tests.backends.slurm_harness import SlurmHarness  # noqa: E402

HARNESSES["slurm"] = SlurmHarness
