"""Scenario evaluations: the agent on the simulator, with expected outcomes and a score.

Each scenario is a small cluster, a script of arrivals, and a *truth* the
simulated world follows but nobody declares (a run whose loss diverges at
some moment, a node that degrades and then fails, a job whose real memory
peak is above its request). It runs twice on the same seed: once with the
agent ticking every ``tick_s`` seconds, once without (the baseline), both
through the same control plane, scheduler and reconciler. Expectations are
checked on the agent's run (and on the difference to the baseline, so a
scenario the scheduler alone would pass proves nothing); KPIs of both runs
are reported.

Scenarios: an SLA fine-tune arrives into a full cluster; a run's loss
diverges; a node fails; an OOM crash loop; a starving queue.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.loop import Agent, AgentConfig
from mlwe.agent.model import Mode
from mlwe.agent.reasoners.base import Reasoner
from mlwe.agent.workflows import WorkflowRunner
from mlwe.core.actions import Submit
from mlwe.core.backend import StartCommand, Telemetry
from mlwe.core.cluster import build_control_plane
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from mlwe.core.spec import ClusterSpec, NodePool, QueueSpec, WorkloadKind, WorkloadSpec
from mlwe.sim.backend import SimBackend, SimBackendConfig, SimRun
from mlwe.sim.driver import Driver
from mlwe.sim.kernel import Kernel

H = 3600.0


# ======================================================================= truth
@dataclass
class Truth:
    """What the world does that nobody declares."""

    durations: dict[str, float] = field(default_factory=dict)
    peak_memory_mib: dict[str, float] = field(default_factory=dict)  # OOM-killed below this
    oom_after_s: dict[str, float] = field(default_factory=dict)
    diverge_at: dict[str, float] = field(default_factory=dict)  # absolute time
    #: node -> (errors start, node fails) absolute times
    node_degrades: dict[str, tuple[float, float]] = field(default_factory=dict)


class WorldBackend(SimBackend):
    """The simulator's backend plus the scenario's truth: OOM kills below the true
    peak, loss curves that diverge, nodes that report ECC errors before failing,
    memory telemetry, and checkpoint-on-signal for workloads that checkpoint (build
    it with ``checkpoint_on_signal=True``). It overrides only the simulator's public
    run-model hooks."""

    truth: Truth

    def setup(self, truth: Truth) -> None:
        self.truth = truth
        self.wasted_gpu_s = 0.0  # GPU time of runs after their loss diverged
        self._diverged_since: dict[str, float] = {}
        for node, (t_err, t_fail) in truth.node_degrades.items():
            self.fail_node(t_fail, node)
            self.kernel.at(t_err, self._node_sample, node)
        iv = self.config.telemetry_interval_s or 300.0
        for node in self.nodes:
            if node not in truth.node_degrades:
                self.kernel.at(self.kernel.clock.t + iv, self._node_sample, node)

    nodes: tuple[str, ...] = ()

    def on_start(self, c: StartCommand) -> None:
        peak = self.truth.peak_memory_mib.get(c.workload)
        run = self.run_of(c.workload)
        if (peak is not None and c.spec.resources.memory < peak and run is not None
                and run.attempt == c.attempt and not run.finished):
            after = self.truth.oom_after_s.get(c.workload, 600.0)
            self.kernel.at(run.t_start + after, self._oom, (c.workload, c.attempt))

    def _oom(self, arg: tuple[str, int]) -> None:
        self.crash(arg[0], arg[1], 137, "oom")

    def on_release(self, workload: str, attempt: int) -> None:
        self._stop_waste(workload)

    def _stop_waste(self, wid: str) -> None:
        since = self._diverged_since.pop(wid, None)
        run = self.run_of(wid)
        if since is not None and run is not None:
            gpus = run.spec.resources.gpu * run.spec.replicas / 1000
            self.wasted_gpu_s += gpus * max(0.0, self.kernel.clock.t - since)

    def on_finish(self, workload: str, attempt: int) -> bool:
        if self.current(workload, attempt) is not None:
            self._stop_waste(workload)
        return True

    def close_waste(self) -> None:
        for wid in list(self._diverged_since):
            self._stop_waste(wid)

    def _node_sample(self, node: str) -> None:
        now = self.kernel.clock.t
        if self.is_down(node):
            return
        deg = self.truth.node_degrades.get(node)
        errors = 0.0
        if deg is not None and now >= deg[0]:
            errors = 4.0 * (1 + (now - deg[0]) // (self.config.telemetry_interval_s or 300.0))
        self.telemetry.append(Telemetry(now, node, None, {"ecc_errors": errors,
                                                          "gpu_temp_c": 62.0 + errors}))
        self.kernel.at(now + (self.config.telemetry_interval_s or 300.0), self._node_sample, node)

    def sample_metrics(self, run: SimRun, now: float) -> dict[str, float]:
        spec = run.spec
        rng = self.rng
        gpus = spec.resources.gpu / 1000
        util = 0.0 if not gpus else min(1.0, 0.55 + 0.4 * rng.random())
        metrics: dict[str, float] = {"gpu_util": util, "cpu_util": 0.3 + 0.6 * rng.random()}
        work = run.base_work + max(0.0, now - run.t_start - run.overhead)
        total = max(1.0, self.durations[run.workload])
        metrics["progress"] = round(min(1.0, work / total), 4)
        peak = self.truth.peak_memory_mib.get(run.workload)
        limit = spec.resources.memory
        if peak is not None:
            after = self.truth.oom_after_s.get(run.workload, 600.0)
            ran = max(0.0, now - run.t_start)
            metrics["memory_used_mib"] = min(limit, peak * (0.5 + 0.5 * min(1.0, ran / after)))
        else:
            metrics["memory_used_mib"] = 0.6 * limit
        if spec.kind in (WorkloadKind.TRAINING, WorkloadKind.FINE_TUNE):
            loss = 2.5 * math.exp(-3.0 * work / total) + 0.1 + 0.02 * rng.random()
            t_div = self.truth.diverge_at.get(run.workload)
            if t_div is not None and now >= t_div:
                self._diverged_since.setdefault(run.workload, t_div)
                loss *= math.exp((now - t_div) / 1200.0)
            metrics["loss"] = loss
        return metrics


# ==================================================================== scenario
@dataclass
class World:
    cp: ControlPlane
    kernel: Kernel
    backend: WorldBackend
    agent: Agent | None
    horizon_s: float
    wall_s: float = 0.0

    def w(self, wid: str) -> Any:
        return self.cp.workloads[wid]

    def finish_time(self, wid: str) -> float | None:
        w = self.cp.workloads[wid]
        for tr in reversed(w.history):
            if tr.target is State.SUCCEEDED:
                return tr.time
        return None

    def first_start(self, wid: str) -> float | None:
        for tr in self.cp.workloads[wid].history:
            if tr.target is State.RUNNING:
                return tr.time
        return None

    def committed(self) -> list[str]:
        return [o.plan or "" for o in (self.agent.outcomes if self.agent else ())
                if o.outcome == "committed"]


Expect = Callable[[World, World], list[tuple[str, bool, str]]]
Kpis = Callable[[World], dict[str, float]]


@dataclass
class Scenario:
    name: str
    description: str
    cluster: ClusterSpec
    arrivals: list[tuple[float, WorkloadSpec]]
    truth: Truth
    horizon_s: float
    expect: Expect
    kpis: Kpis


def _spec(**kw: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kw)


def run_world(
    sc: Scenario,
    *,
    with_agent: bool,
    reasoner: Reasoner | str | None = None,
    mode: Mode = Mode.AUTONOMOUS,
    tick_s: float = 60.0,
    seed: int = 0,
    after_tick: Callable[[ControlPlane, Agent], None] | None = None,
) -> World:
    """One run of ``sc``; ``after_tick`` is called after every agent round (the soak
    checks the invariants there)."""
    wall0 = time.perf_counter()
    kernel = Kernel()
    cp = build_control_plane(sc.cluster, kernel.clock)
    backend = WorldBackend(kernel, sc.truth.durations,
                           SimBackendConfig(telemetry_interval_s=300.0, eviction_delay_s=5.0,
                                            seed=seed, checkpoint_on_signal=True))
    backend.nodes = tuple(cp.capacity.node_names())
    backend.setup(sc.truth)
    rec = Reconciler(cp, Scheduler(), grace_s=30.0)
    # the hooks (the agent's tick) propose actions: one more step after them
    drv = Driver(kernel, rec, backend, restep_after_hooks=True)
    agent = None
    if with_agent:
        # the agent carries preemption and recovery plans through workflows, as in the
        # runtime (there the engine's store keeps them; here they live in memory)
        flows = WorkflowRunner(cp, scheduler=rec.scheduler)
        agent = Agent(cp, reasoner=reasoner, mode=mode, workflows=flows,
                      config=AgentConfig(min_interval_s=tick_s))

        def hook(_t: float) -> None:
            assert agent is not None
            agent.observe(backend.drain_telemetry())
            agent.tick()
            if after_tick is not None:
                after_tick(cp, agent)
            if flows.tick():
                rec.dirty = True  # a workflow step may have placed or retried something
            wake_at = flows.next_wakeup()
            if wake_at is not None and wake_at > kernel.clock.t:
                kernel.at(wake_at, lambda _: None)

        drv.hooks.append(hook)

        def wake(_: Any) -> None:
            kernel.at(kernel.clock.t + tick_s, wake)

        kernel.at(tick_s, wake)
    else:
        def drain(_t: float) -> None:
            backend.drain_telemetry()

        drv.hooks.append(drain)

    def submit(spec: WorkloadSpec) -> None:
        r = cp.apply([Submit(spec)], cause_id=f"scenario:{spec.id}")
        if not r.accepted:
            raise ValueError(f"{sc.name}: {spec.id} rejected: {'; '.join(r.reasons())}")
        rec.dirty = True

    for t, spec in sc.arrivals:
        kernel.at(t, submit, spec)
    drv.run(sc.horizon_s)
    backend.close_waste()
    cp.assert_valid()
    return World(cp, kernel, backend, agent, sc.horizon_s, time.perf_counter() - wall0)


def _h(t: float | None) -> str:
    return "never" if t is None else f"{t / H:.2f}h"


def _common_kpis(w: World) -> dict[str, float]:
    cp = w.cp
    done = [x for x in cp.workloads.values() if x.state is State.SUCCEEDED]
    jcts = [(w.finish_time(x.id) or 0.0) - x.submit_time for x in done]
    return {
        "completed": float(len(done)),
        "mean_jct_h": round(sum(jcts) / len(jcts) / H, 3) if jcts else 0.0,
        "lost_gpu_h": round(w.backend.lost_gpu_s / H, 3),
        "wasted_gpu_h": round(w.backend.wasted_gpu_s / H, 3),
        "failed": float(sum(1 for x in cp.workloads.values() if x.state is State.FAILED)),
    }


# ================================================================== scenarios
def sla_fine_tune() -> Scenario:
    cluster = ClusterSpec(pools=(NodePool(prefix="a100", count=2, gpu_model="A100-80GB", gpus=8,
                                          cpu=96, memory="1Ti"),))
    arrivals: list[tuple[float, WorkloadSpec]] = []
    durations: dict[str, float] = {}
    for i in range(4):
        arrivals.append((0.0, _spec(id=f"train-{i}", name=f"training run {i}", kind="training",
                                    priority="normal", resources={"gpu": 4, "cpu": 16, "memory": "128Gi"},
                                    estimated_duration="6h", checkpoint_interval="15m")))
        durations[f"train-{i}"] = 6 * H
    arrivals.append((1 * H, _spec(id="ft-sla", name="SLA fine-tune", kind="fine-tune",
                                  priority="normal", resources={"gpu": 8, "cpu": 32, "memory": "256Gi"},
                                  estimated_duration="2h", deadline_in="3h",
                                  checkpoint_interval="15m")))
    durations["ft-sla"] = 2 * H

    def expect(a: World, b: World) -> list[tuple[str, bool, str]]:
        ft = a.w("ft-sla")
        fin = a.finish_time("ft-sla")
        base_fin = b.finish_time("ft-sla")
        trains_ok = all(a.w(f"train-{i}").state is State.SUCCEEDED for i in range(4))
        return [
            ("fine-tune meets its deadline", fin is not None and ft.deadline is not None
             and fin <= ft.deadline, f"finished at {_h(fin)}, deadline"
             f" {_h(ft.deadline)}"),
            ("without the agent it misses", base_fin is None or (ft.deadline is not None
             and base_fin > ft.deadline), f"baseline finish {_h(base_fin)}"),
            ("preempted training runs still finish", trains_ok,
             ", ".join(f"train-{i}: {a.w(f'train-{i}').state.value}" for i in range(4))),
            ("the agent committed a plan", bool(a.committed()), ", ".join(a.committed())),
        ]

    def kpis(w: World) -> dict[str, float]:
        ft = w.w("ft-sla")
        fin = w.finish_time("ft-sla")
        return {**_common_kpis(w),
                "sla_met": float(fin is not None and fin <= (ft.deadline or 0)),
                "sla_finish_h": round(fin / H, 3) if fin else -1.0}

    return Scenario("sla-fine-tune", "an SLA fine-tune (deadline 3h) arrives into a full cluster"
                    " of equal-priority training runs", cluster, arrivals,
                    Truth(durations=durations), 12 * H, expect, kpis)


def loss_diverges() -> Scenario:
    cluster = ClusterSpec(pools=(NodePool(prefix="a100", count=1, gpu_model="A100-80GB", gpus=8,
                                          cpu=96, memory="1Ti"),))
    arrivals = [
        (0.0, _spec(id="pretrain", name="pretraining run", kind="training", priority="normal",
                    resources={"gpu": 8, "cpu": 32, "memory": "256Gi"},
                    estimated_duration="8h", checkpoint_interval="30m")),
        (0.5 * H, _spec(id="ft-next", name="queued fine-tune", kind="fine-tune",
                        priority="normal", resources={"gpu": 8, "cpu": 32, "memory": "256Gi"},
                        estimated_duration="2h", checkpoint_interval="30m")),
    ]
    truth = Truth(durations={"pretrain": 8 * H, "ft-next": 2 * H}, diverge_at={"pretrain": 1 * H})

    def expect(a: World, b: World) -> list[tuple[str, bool, str]]:
        p = a.w("pretrain")
        stop = next((tr.time for tr in p.history if tr.target is State.STOPPING), None)
        return [
            ("diverged run stopped within 1h of divergence", stop is not None and stop - H <= H,
             f"stopped at {_h(stop)} (diverged at 1.00h)"),
            ("GPU time wasted on it is under 25% of the baseline's",
             a.backend.wasted_gpu_s < 0.25 * b.backend.wasted_gpu_s,
             f"{a.backend.wasted_gpu_s / H:.1f} vs {b.backend.wasted_gpu_s / H:.1f} GPU-h"),
            ("the queued fine-tune finished", a.w("ft-next").state is State.SUCCEEDED,
             a.w("ft-next").state.value),
        ]

    def kpis(w: World) -> dict[str, float]:
        fin = w.finish_time("ft-next")
        return {**_common_kpis(w), "queued_finish_h": round(fin / H, 3) if fin else -1.0}

    return Scenario("loss-diverges", "a training run's loss diverges while another job waits",
                    cluster, arrivals, truth, 10 * H, expect, kpis)


def node_fails() -> Scenario:
    cluster = ClusterSpec(pools=(NodePool(prefix="a100", count=3, gpu_model="A100-80GB", gpus=8,
                                          cpu=96, memory="1Ti"),))
    arrivals = []
    durations = {}
    for i in range(4):
        arrivals.append((0.0, _spec(id=f"job-{i}", name=f"training {i}", kind="training",
                                    priority="normal", resources={"gpu": 4, "cpu": 16, "memory": "128Gi"},
                                    estimated_duration="5h", checkpoint_interval="1h")))
        durations[f"job-{i}"] = 5 * H
    truth = Truth(durations=durations, node_degrades={"a100-0": (1.5 * H, 2.75 * H)})

    def on_failed_node(w: World) -> list[str]:
        t_fail = 2.75 * H
        out = []
        for x in w.cp.workloads.values():
            for tr in x.history:
                if tr.target is State.FAILED and "node-lost" in tr.reason and abs(tr.time - t_fail) < 1:
                    out.append(x.id)
        return out

    def expect(a: World, b: World) -> list[tuple[str, bool, str]]:
        hit = on_failed_node(a)
        return [
            ("work moved off the degrading node before it failed", not hit and bool(on_failed_node(b)),
             f"lost with the node: {hit or 'none'} (baseline: {on_failed_node(b)})"),
            ("less work lost than without the agent", a.backend.lost_gpu_s < b.backend.lost_gpu_s,
             f"{a.backend.lost_gpu_s / H:.2f} vs {b.backend.lost_gpu_s / H:.2f} GPU-h"),
            ("every job finishes", all(x.state is State.SUCCEEDED for x in a.cp.workloads.values()),
             ", ".join(f"{x.id}: {x.state.value}" for x in a.cp.workloads.values())),
        ]

    def kpis(w: World) -> dict[str, float]:
        return {**_common_kpis(w), "jobs_hit_by_failure": float(len(on_failed_node(w)))}

    return Scenario("node-fails", "a node reports rising ECC errors, then fails", cluster,
                    arrivals, truth, 10 * H, expect, kpis)


def oom_crash_loop() -> Scenario:
    cluster = ClusterSpec(pools=(NodePool(prefix="a100", count=1, gpu_model="A100-80GB", gpus=8,
                                          cpu=96, memory="512Gi"),))
    arrivals = [(0.0, _spec(id="ft-oom", name="fine-tune with an undersized memory request",
                            kind="fine-tune", priority="normal",
                            resources={"gpu": 2, "cpu": 8, "memory": "32Gi"},
                            estimated_duration="2h", checkpoint_interval="20m", max_retries=3))]
    truth = Truth(durations={"ft-oom": 2 * H}, peak_memory_mib={"ft-oom": 44 * 1024},
                  oom_after_s={"ft-oom": 600.0})

    def expect(a: World, b: World) -> list[tuple[str, bool, str]]:
        w, base = a.w("ft-oom"), b.w("ft-oom")
        return [
            ("it succeeds", w.state is State.SUCCEEDED, w.state.value),
            ("its memory request was raised above the true peak",
             w.spec.resources.memory >= 44 * 1024, f"{w.spec.resources.memory} MiB"),
            ("the agent stopped the loop after at most 2 failures", w.failures <= 2,
             f"{w.failures} failures"),
            ("without the agent it fails for good", base.state is State.FAILED,
             f"baseline: {base.state.value} after {base.failures} failures"),
        ]

    def kpis(w: World) -> dict[str, float]:
        x = w.w("ft-oom")
        return {**_common_kpis(w), "oom_failures": float(x.failures),
                "memory_request_gib": x.spec.resources.memory / 1024}

    return Scenario("oom-crash-loop", "a fine-tune is OOM-killed on every attempt", cluster,
                    arrivals, truth, 6 * H, expect, kpis)


def starving_queue() -> Scenario:
    cluster = ClusterSpec(pools=(NodePool(prefix="a100", count=1, gpu_model="A100-80GB", gpus=8,
                                          cpu=96, memory="1Ti"),),
                          queues=(QueueSpec(name="research"),))
    arrivals: list[tuple[float, WorkloadSpec]] = []
    durations = {}
    for i in range(24):
        wid = f"batch-{i}"
        arrivals.append((i * 0.5 * H, _spec(id=wid, name=f"batch shard {i}", kind="batch-embedding",
                                            priority="batch", resources={"gpu": 4, "cpu": 8, "memory": "64Gi"},
                                            estimated_duration="1h")))
        durations[wid] = 1 * H
    arrivals.append((0.1 * H, _spec(id="res-eval", name="research evaluation", kind="other",
                                    queue="research", priority="low",
                                    resources={"gpu": 8, "cpu": 16, "memory": "128Gi"},
                                    estimated_duration="1h")))
    durations["res-eval"] = 1 * H

    def expect(a: World, b: World) -> list[tuple[str, bool, str]]:
        start = a.first_start("res-eval")
        base_start = b.first_start("res-eval")
        return [
            ("the starving job starts within 4h of arriving", start is not None
             and start - 0.1 * H <= 4 * H, f"started at {_h(start)}"),
            ("it finishes", a.w("res-eval").state is State.SUCCEEDED, a.w("res-eval").state.value),
            ("without the agent it starves", base_start is None or base_start - 0.1 * H > 4 * H,
             f"baseline start {_h(base_start)}"),
        ]

    def kpis(w: World) -> dict[str, float]:
        s = w.first_start("res-eval")
        return {**_common_kpis(w), "starved_wait_h": round(((s or w.horizon_s) - 0.1 * H) / H, 3)}

    return Scenario("starving-queue", "a low-priority research job waits behind an endless"
                    " stream of batch work", cluster, arrivals, Truth(durations=durations),
                    12 * H, expect, kpis)


SCENARIOS: Mapping[str, Callable[[], Scenario]] = {
    "sla-fine-tune": sla_fine_tune,
    "loss-diverges": loss_diverges,
    "node-fails": node_fails,
    "oom-crash-loop": oom_crash_loop,
    "starving-queue": starving_queue,
}


def check_scenarios(names: list[str] | None) -> list[str]:
    chosen = names or list(SCENARIOS)
    unknown = [n for n in chosen if n not in SCENARIOS]
    if unknown:
        raise ValueError(f"unknown scenario(s) {', '.join(unknown)}; known: {', '.join(SCENARIOS)}")
    return chosen


def evaluate(
    names: list[str] | None = None,
    *,
    reasoner: str | Reasoner = "rules",
    seed: int = 0,
    max_deliberations: int | None = None,
) -> dict[str, Any]:
    """Run the scenarios with and without the agent; per-scenario pass/fail and KPIs.

    ``reasoner``: a name (built with its defaults and the environment) or a reasoner
    (an LLM one configured by the caller: ``mlwe agent eval --reasoner openai
    --base-url ...``). ``max_deliberations``: per scenario, the reasoner is asked at
    most this often; past it the agent decides nothing (a slow model's bounded run:
    each scenario's ``agent.budget_spent`` says whether it was reached)."""
    from mlwe.agent.metered import MeteredReasoner

    if max_deliberations is not None and max_deliberations < 1:
        raise ValueError("max_deliberations must be at least 1")
    chosen = check_scenarios(names)
    if isinstance(reasoner, str):
        from mlwe.agent.reasoners import make_reasoner

        reasoner = make_reasoner(reasoner)
    results: list[dict[str, Any]] = []
    for name in chosen:
        sc = SCENARIOS[name]()
        metered = MeteredReasoner(reasoner, max_deliberations or 1 << 62)
        agent_run = run_world(sc, with_agent=True, reasoner=metered, seed=seed)
        base_run = run_world(sc, with_agent=False, seed=seed)
        checks: list[tuple[str, bool, str]] = sc.expect(agent_run, base_run)
        assert agent_run.agent is not None
        results.append({
            "scenario": name,
            "description": sc.description,
            "passed": all(bool(ok) for _, ok, _ in checks),
            "score": round(sum(1 for _, ok, _ in checks if ok) / len(checks), 3),
            "expectations": [{"name": n, "ok": bool(ok), "detail": d} for n, ok, d in checks],
            "kpis": {"agent": sc.kpis(agent_run), "baseline": sc.kpis(base_run)},
            "agent": {
                "committed": agent_run.committed(),
                "decisions": len(agent_run.agent.outcomes),
                "deliberations": metered.deliberations,
                "budget_spent": metered.spent,
                "reasoner_ms_p50": _p50(metered.latency_ms),
                "outcomes": _count(o.outcome for o in agent_run.agent.outcomes),
                "forecasts": agent_run.agent.whatif.runs,
                "analyses": agent_run.agent.analyses,
                "workflows": _workflows(agent_run.agent),
            },
            "wall_s": round(agent_run.wall_s + base_run.wall_s, 3),
        })
    passed = sum(r["passed"] for r in results)
    return {
        "reasoner": reasoner.name,
        "model": getattr(reasoner, "model", None),
        "seed": seed,
        "max_deliberations": max_deliberations,
        "passed": passed,
        "total": len(results),
        "score": round(sum(r["score"] for r in results) / len(results), 3) if results else 0.0,
        "scenarios": results,
    }


def _p50(xs: list[float]) -> float:
    s = sorted(xs)
    return round(s[len(s) // 2], 1) if s else 0.0


def _workflows(agent: Agent) -> list[dict[str, Any]]:
    """The workflows the agent's plans ran: kind, status, steps done, summary or error."""
    flows = agent.workflows
    if flows is None:
        return []
    return [{"id": wf.id, "kind": wf.kind, "status": wf.status,
             "steps": [e["step"] for e in wf.log if e["event"] == "step-done"],
             "summary": wf.data.get("summary") or wf.data.get("error")}
            for wf in flows.workflows()]


def _count(xs: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for x in xs:
        out[x] = out.get(x, 0) + 1
    return dict(sorted(out.items()))
