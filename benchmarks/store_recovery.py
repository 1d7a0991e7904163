"""Recovery time of a large store: ``recover()`` of 100,000 workloads (figures, not a test).

Was ``tests/store/test_recovery.py::test_recovery_of_100k_workloads_is_timed``,
which only printed its timing. Bulk-loads ``--n`` synthetic workloads (a mix of
running, waiting, preempted and finished ones, with their histories) into a
scratch store, then times ``recover()`` into a new control plane, including the
full invariant sweep (:func:`mlwe.store.bench.measure_recovery`; it raises if
not every stored workload came back). The README's target is <= 5 s for
100,000 workloads on SQLite; ``mlwe bench engine-store`` and ``mlwe bench
store-direct`` report the same ``recovery_s`` next to their submission figures.

Prints one JSON line: ``n``, ``recovery_s``, ``recovery_cpu_s``, ``load_data_s``,
``wall_s`` (the whole run, loading included).

    .venv/bin/python benchmarks/store_recovery.py [--n 100000] [--backend sqlite|postgres]
        [--url URL]
"""

from __future__ import annotations

import argparse
import json
import os
import time

from mlwe.store.bench import measure_recovery, scratch_engine
from mlwe.store.repository import Repository


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=int(os.environ.get("MLWE_RECOVERY_N", "100000")),
                        help="stored workloads to recover (default $MLWE_RECOVERY_N or 100000)")
    parser.add_argument("--backend", choices=("sqlite", "postgres"), default="sqlite")
    parser.add_argument("--url", default=None, help="database URL (postgres)")
    args = parser.parse_args()
    t0 = time.perf_counter()
    with scratch_engine(args.backend, args.url) as engine:
        got = measure_recovery(Repository(engine), args.n)
    print(json.dumps({
        "bench": "store-recovery", "backend": args.backend, "n": args.n,
        "recovery_s": round(got["recovery_s"], 3),
        "recovery_cpu_s": round(got["recovery_cpu_s"], 3),
        "load_data_s": round(got["load_data_s"], 3),
        "wall_s": round(time.perf_counter() - t0, 1),
    }), flush=True)


if __name__ == "__main__":
    main()
