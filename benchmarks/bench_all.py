"""Run every benchmark the issues set targets for and print one JSON line each.

Figures, not tests: run on a quiet machine and compare ratios within one run.
    .venv/bin/python benchmarks/bench_all.py [--quick]
"""

from __future__ import annotations

import json
import sys
import time

from mlwe.sim.bench import bench_core
from mlwe.sim.kernel import bench_kernel
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace


def main() -> None:
    quick = "--quick" in sys.argv
    nodes = 500 if quick else 5000
    runs = [
        ("core-placement", lambda: bench_core(nodes=nodes, pending=2 * nodes, running=0,
                                               preemptions=0)),
        ("core-preemption", lambda: bench_core(nodes=nodes, pending=0, running=4 * nodes)),
        ("kernel", lambda: bench_kernel(100_000 if quick else 1_000_000)),
    ]
    for name, fn in runs:
        print(json.dumps({"bench": name, **fn()}), flush=True)
    t = time.perf_counter()
    trace = load_trace("philly", limit=5000 if quick else None)
    load_s = time.perf_counter() - t
    m = replay(trace, ReplayConfig(policy="mlwe")).metrics
    print(json.dumps({"bench": "philly-replay", "load_s": round(load_s, 2),
                      **{k: m[k] for k in ("jobs", "wall_s", "events", "events_per_s",
                                           "invariant_checks")}}), flush=True)


if __name__ == "__main__":
    main()
