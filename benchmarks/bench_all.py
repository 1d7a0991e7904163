"""Run every benchmark the issues set targets for and print one JSON line each.

Figures, not tests: run on a quiet machine and compare ratios within one run.
    .venv/bin/python benchmarks/bench_all.py [--quick]
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

from mlwe.sim.bench import bench_core
from mlwe.sim.kernel import bench_kernel
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace
from mlwe.store.sanitize import sanitize


def sanitize_speed(n: int = 5_000) -> dict[str, float]:
    """Microseconds to sanitise a typical decision payload (was a print-only test)."""
    payload = {
        "kind": "place",
        "workload": "llama3-ft-42",
        "policy": "deadline-aware",
        "reasons": ["fits on node-a100-03", "deadline reachable with 2h margin"],
        "candidates": [f"node-a100-{i:02d}" for i in range(16)],
        "inputs_digest": "9fceb02d0ae598e9",
        "time": 1234.5,
    }
    start = time.perf_counter()
    for _ in range(n):
        sanitize(payload)
    return {"payloads": n, "us_per_payload": round((time.perf_counter() - start) / n * 1e6, 1)}


def main() -> None:
    quick = "--quick" in sys.argv
    nodes = 500 if quick else 5000
    runs = [
        ("core-placement", lambda: bench_core(nodes=nodes, pending=2 * nodes, running=0,
                                               preemptions=0)),
        ("core-preemption", lambda: bench_core(nodes=nodes, pending=0, running=4 * nodes)),
        ("kernel", lambda: bench_kernel(100_000 if quick else 1_000_000)),
        ("sanitize", sanitize_speed),
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
    # the engine-level figures: each command prints one JSON document
    mlwe = str(Path(sys.executable).with_name("mlwe"))
    commands = [
        ("engine-store-sqlite", [mlwe, "bench", "engine-store", "--backend", "sqlite", "--json",
                                 *(["--recover", "10000"] if quick else [])]),
        ("engine-store-postgres", [mlwe, "bench", "engine-store", "--backend", "postgres",
                                   "--json", *(["--recover", "10000"] if quick else [])]),
        ("backend-local", [mlwe, "bench", "backend", "--backend", "local", "--json"]),
        ("api", [mlwe, "bench", "api", "--json"]),
        ("agent-eval", [mlwe, "agent", "eval", "--json"]),
    ]
    for name, argv in commands:
        run = subprocess.run(argv, capture_output=True, text=True)
        last = (run.stdout.strip().splitlines() or ["{}"])[-1]
        try:
            doc = json.loads(last)
        except ValueError:
            doc = {"error": (run.stderr or run.stdout)[-500:], "exit": run.returncode}
        print(json.dumps({"bench": name, **doc} if isinstance(doc, dict) else
                         {"bench": name, "result": doc}), flush=True)
    here = Path(__file__).with_name("case_studies.py")
    subprocess.run([sys.executable, str(here)], check=False)


if __name__ == "__main__":
    main()
