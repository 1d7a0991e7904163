"""Digest of every decision a replay makes: the check behind "decisions byte-identical".

    .venv/bin/python benchmarks/decision_digest.py [--cases NAME,...]

Replays each case with every decision record kept and prints one JSON line:
the case, how many records, the first 16 hex digits of a SHA-256 over all of
them (kind, workload, policy, choice, reasons, candidates, input digest, extra),
the same over the records that act (every kind but "unschedulable", which only
says why a workload waits), and the average JCT. Run it on two commits (e.g. a
``git worktree`` of the base with ``PYTHONPATH=<worktree>/src``): equal lines
mean the same decisions, word for word, in the same order. A change meant to be
only faster must leave every line equal, or, where it refreshes fewer wait
reasons (a turn passed over keeps the reason it carries), every acting digest;
a policy change says in its message which lines move.

Cases (all by default):
  philly-800-mlwe      philly --limit 800 on nodes:8x8, mlwe
  philly-800-tiresias  the same input, tiresias
  itp02-600-mlwe       itp:02 --limit 600, mlwe (deadlines)
  synthetic-mlwe       the synthetic mix, mlwe
  philly-2000-mlwe     philly --limit 2000 on nodes:16x8, mlwe (gain preemption)
  philly-2000-drain    the same input, mlwe-drain (gain preemption with drain plans)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from typing import Any

from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import load_trace

CASES: dict[str, tuple[str, dict[str, Any], str]] = {
    "philly-800-mlwe": ("philly", {"limit": 800, "cluster": "nodes:8x8"}, "mlwe"),
    "philly-800-tiresias": ("philly", {"limit": 800, "cluster": "nodes:8x8"}, "tiresias"),
    "itp02-600-mlwe": ("itp:02", {"limit": 600}, "mlwe"),
    "synthetic-mlwe": ("synthetic", {}, "mlwe"),
    "philly-2000-mlwe": ("philly", {"limit": 2000, "cluster": "nodes:16x8"}, "mlwe"),
    "philly-2000-drain": ("philly", {"limit": 2000, "cluster": "nodes:16x8"}, "mlwe-drain"),
}


def digest_case(name: str) -> dict[str, Any]:
    """Replay case ``name`` keeping every decision; its record count and digest."""
    trace_name, kw, policy = CASES[name]
    result = replay(load_trace(trace_name, **kw), ReplayConfig(policy=policy, keep_decisions=10**7))
    h, acts = hashlib.sha256(), hashlib.sha256()
    n_acts = 0
    for d in result.decisions:
        text = repr((d.kind, d.workload, d.policy, d.chosen, d.reasons, d.candidates,
                     d.inputs_digest, sorted(d.extra.items()))).encode()
        h.update(text)
        if d.kind != "unschedulable":
            acts.update(text)
            n_acts += 1
    return {
        "case": name,
        "records": len(result.decisions),
        "sha256_16": h.hexdigest()[:16],
        "acting_records": n_acts,
        "acting_sha256_16": acts.hexdigest()[:16],
        "avg_jct_s": result.metrics["avg_jct_s"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(CASES))
    args = ap.parse_args()
    for name in [x.strip() for x in args.cases.split(",") if x.strip()]:
        if name not in CASES:
            sys.exit(f"unknown case {name!r}; known: {', '.join(CASES)}")
        print(json.dumps(digest_case(name), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
