"""Engine tick latency with the rules agent attached (figures, not a test).

A cluster of ~50 nodes (40 x 8-GPU A100 nodes, 10 CPU nodes) and ~300
workloads on the live simulated backend, a real Engine on SQLite in a scratch
directory, the agent attached as ``mlwe serve`` attaches it. Deadline-bound
fine-tunes keep arriving into the full cluster (so the agent analyses, plans
and forecasts), and a node fails half way. The engine clock advances 0.25 s
per tick (the engine's default period); between ticks the loop sleeps
``--gap`` seconds of wall time, as the real loop waits for its period.

Prints one JSON line: tick latency p50/p90/p99/max (ms), ticks, the agent's
analyses, forecasts and outcomes, and (background mode) how long the agent
held the engine lock per round and the forecast time spent outside it.

    .venv/bin/python benchmarks/agent_tick_latency.py [--ticks 1200] [--gap 0.01]
        [--inline] [--no-agent]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import threading
import time
from collections import Counter
from typing import Any

from mlwe.core.clock import ManualClock
from mlwe.core.spec import ClusterSpec, NodePool, WorkloadSpec
from mlwe.runtime import Engine, LiveSimBackend


def _spec(**kw: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate(kw)


def cluster() -> ClusterSpec:
    return ClusterSpec(pools=(
        NodePool(prefix="gpu", count=40, gpu_model="A100-80GB", gpus=8, cpu=96, memory="1Ti"),
        NodePool(prefix="cpu", count=10, cpu=64, memory="512Gi"),
    ))


def workloads(n: int) -> list[WorkloadSpec]:
    out = []
    for i in range(n):
        k = i % 10
        if k < 6:  # GPU training / fine-tunes, 1..8 GPUs
            gpus = (1, 2, 4, 8)[i % 4]
            out.append(_spec(id=f"train-{i}", name=f"train {i}", kind="training",
                             priority=("low", "normal", "batch")[i % 3],
                             resources={"gpu": gpus, "cpu": 4 * gpus, "memory": f"{16 * gpus}Gi"},
                             estimated_duration=f"{1 + i % 5}h", checkpoint_interval="10m"))
        elif k < 8:  # batch embedding
            out.append(_spec(id=f"embed-{i}", name=f"embed {i}", kind="batch-embedding",
                             priority="batch", resources={"gpu": 1, "cpu": 4, "memory": "16Gi"},
                             estimated_duration="40m"))
        else:  # CPU data processing
            out.append(_spec(id=f"etl-{i}", name=f"etl {i}", kind="data-processing",
                             priority="normal", resources={"cpu": 8, "memory": "32Gi"},
                             estimated_duration="30m"))
    return out


class TimedLock:
    """The engine's RLock, counting how long the engine thread waited to take it."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.owner = threading.get_ident()  # the thread that ticks the engine
        self.waited_ms = 0.0

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        t = time.perf_counter()
        got: bool = self.inner.acquire(blocking, timeout)
        if threading.get_ident() == self.owner:
            self.waited_ms += (time.perf_counter() - t) * 1000
        return got

    def release(self) -> None:
        self.inner.release()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()

    def _is_owned(self) -> bool:
        return bool(self.inner._is_owned())


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ticks", type=int, default=1200)
    ap.add_argument("--gap", type=float, default=0.01, help="wall seconds between ticks")
    ap.add_argument("--workloads", type=int, default=300)
    ap.add_argument("--inline", action="store_true", help="agent analyses inside the tick")
    ap.add_argument("--no-agent", action="store_true")
    ap.add_argument("--interval", type=float, default=None, help="agent analysis interval (s)")
    ap.add_argument("--switch", type=float, default=None, help="sys.setswitchinterval (s)")
    args = ap.parse_args()
    if args.switch:
        sys.setswitchinterval(args.switch)

    clock = ManualClock(0.0)
    with tempfile.TemporaryDirectory() as tmp:
        backend = LiveSimBackend(clock, default_duration_s=1800.0)
        eng = Engine.open(cluster(), backend, data_dir=tmp, clock=clock)
        eng.submit(workloads(args.workloads), actor="bench")
        timed = TimedLock(eng.lock)
        eng.lock = timed  # type: ignore[assignment]
        agent = None
        if not args.no_agent:
            from mlwe.agent.loop import AgentConfig
            from mlwe.runtime.wiring import attach_agent as attach

            cfg = AgentConfig()
            kw: dict[str, Any] = {"config": cfg}
            if args.interval is not None:
                cfg.analysis_interval_s = args.interval
            if args.inline:
                kw["background"] = False
            try:
                agent = attach(eng, mode="autonomous", **kw)
            except TypeError:  # an agent without these options (the "before" figures)
                agent = attach(eng, mode="autonomous")
        lat: list[float] = []
        waits: list[float] = []
        sla = 0
        t_wall = time.perf_counter()
        for i in range(args.ticks):
            if i % 240 == 120:  # every 60 s of engine time: an urgent fine-tune with a deadline
                sla += 1
                eng.submit([_spec(id=f"sla-{sla}", name=f"sla {sla}", kind="fine-tune",
                                  priority="low",
                                  resources={"gpu": 8, "cpu": 32, "memory": "256Gi"},
                                  estimated_duration="2h", deadline_in="2h10m",
                                  checkpoint_interval="15m")], actor="bench")
            if i == args.ticks // 2:
                backend.fail_node("gpu-3")
            timed.waited_ms = 0.0
            t0 = time.perf_counter()
            eng.tick()
            lat.append((time.perf_counter() - t0) * 1000)
            waits.append(timed.waited_ms)
            clock.advance(0.25)
            if args.gap:
                time.sleep(args.gap)
        wall = time.perf_counter() - t_wall
        out: dict[str, Any] = {
            "bench": "engine-tick-with-agent",
            "agent": "none" if agent is None else (
                "inline" if args.inline or not hasattr(agent, "start_background")
                else "background"),
            "nodes": 50,
            "workloads": len(eng.cp.workloads),
            "ticks": len(lat),
            "wall_s": round(wall, 2),
            "tick_ms_p50": round(statistics.median(lat), 2),
            "tick_ms_p90": round(pct(lat, 0.90), 2),
            "tick_ms_p99": round(pct(lat, 0.99), 2),
            "tick_ms_max": round(max(lat), 2),
            # of which: waiting for the engine lock (held by the agent's thread)
            "tick_lock_wait_ms_p99": round(pct(waits, 0.99), 2),
            "tick_lock_wait_ms_max": round(max(waits), 2),
        }
        if agent is not None:
            if hasattr(agent, "wait_idle"):
                agent.wait_idle(60)
            out["analyses"] = agent.analyses
            out["forecasts"] = agent.whatif.runs
            out["outcomes"] = dict(Counter(o.outcome for o in agent.outcomes))
            stats = getattr(agent, "stats", None)
            if stats is not None:
                out.update(stats.summary())
            agent.close()
        eng.close()
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
