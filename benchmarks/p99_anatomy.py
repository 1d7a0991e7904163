"""Which jobs make a replay's p99 JCT, and why: the tail's anatomy, policy by policy.

    .venv/bin/python benchmarks/p99_anatomy.py [--input philly-3000]
        [--policies mlwe,fifo-backfill] [--checkpoint MODEL] [--show 12]

Replays one input of ``policy_quality.py`` under each policy and prints one JSON
line per policy: its p99 JCT, and of the jobs whose JCT is at or above it (the
tail), how many were preempted and how often, the split of their JCT between
running and not running (queued first, waiting again after a preemption), and the
``--show`` longest of them, each with its JCT under every other policy. The last
line compares the tails: the jobs in one policy's tail and in no other's, those
in every tail, and each policy's p99 over the last policy's (``--policies``
order: fifo-backfill's by default, the bound of the issue's p99 target).

It answers the question a p99 target raises: is the tail made of jobs that
waited long before they first started (what FIFO does to a job arriving behind a
backlog), or of jobs started early and then kept waiting after evictions (what a
size-aware order does to a long job it evicts for short ones)? Figures, not tests.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_quality import INPUTS

from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.sim.checkpoint import parse_checkpoint_model
from mlwe.sim.metrics import percentile
from mlwe.sim.replay import ReplayConfig, replay


def job_times(w: Workload) -> dict[str, Any] | None:
    """A succeeded workload's JCT and its split (seconds): running, queued before its
    first start, and not running after it (waiting again after preemptions, with
    the evictions themselves); None if it did not succeed."""
    hist = w.history
    if w.state is not State.SUCCEEDED or not hist:
        return None
    submit, finish = w.submit_time, hist[-1].time
    running = 0.0
    first_start: float | None = None
    since: float | None = None
    for tr in hist:
        if since is not None:
            running += tr.time - since
            since = None
        if tr.target is State.RUNNING:
            since = tr.time
            if first_start is None:
                first_start = tr.time
    jct = finish - submit
    first = (first_start if first_start is not None else finish) - submit
    return {
        "id": w.id,
        "gpus": round(w.gpus(), 3),
        "jct_s": round(jct, 1),
        "running_s": round(running, 1),
        "first_wait_s": round(first, 1),
        "waiting_after_start_s": round(max(0.0, jct - running - first), 1),
        "preemptions": w.preemptions,
    }


def tail(rows: list[dict[str, Any]]) -> tuple[float, list[dict[str, Any]]]:
    """The p99 JCT (the replay metrics' own percentile) and the jobs at or above it,
    longest first."""
    p99 = percentile([r["jct_s"] for r in rows], 0.99) or 0.0
    return p99, sorted((r for r in rows if r["jct_s"] >= p99), key=lambda r: -r["jct_s"])


def summary(policy: str, p99: float, top: list[dict[str, Any]]) -> dict[str, Any]:
    jct = sum(r["jct_s"] for r in top) or 1.0
    preempted = [r for r in top if r["preemptions"]]
    return {
        "policy": policy,
        "p99_jct_s": p99,
        "tail_jobs": len(top),
        "tail_preempted": len(preempted),
        "tail_preemptions_median": statistics.median(r["preemptions"] for r in top) if top else 0,
        # shares of the tail's summed JCT
        "tail_share_running": round(sum(r["running_s"] for r in top) / jct, 3),
        "tail_share_first_wait": round(sum(r["first_wait_s"] for r in top) / jct, 3),
        "tail_share_waiting_after_start": round(
            sum(r["waiting_after_start_s"] for r in top) / jct, 3),
        "tail_gpus_median": statistics.median(r["gpus"] for r in top) if top else 0,
        "tail_slowdown_median": round(statistics.median(
            r["jct_s"] / max(r["running_s"], 1.0) for r in top), 2) if top else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--input", default="philly-3000", choices=sorted(INPUTS))
    ap.add_argument("--policies", default="mlwe,fifo-backfill")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    ap.add_argument("--show", type=int, default=12, help="tail jobs listed per policy")
    args = ap.parse_args()
    load = INPUTS[args.input][0]
    model = parse_checkpoint_model(args.checkpoint)
    policies = [p for p in args.policies.split(",") if p]
    by: dict[str, dict[str, dict[str, Any]]] = {}
    tails: dict[str, tuple[float, list[dict[str, Any]]]] = {}
    for policy in policies:
        res = replay(load(), ReplayConfig(policy=policy, checkpoint=model))
        rows = [x for w in res.cp.workloads.values() if (x := job_times(w)) is not None]
        by[policy] = {r["id"]: r for r in rows}
        tails[policy] = tail(rows)
    for policy in policies:
        p99, top = tails[policy]
        line = summary(policy, p99, top)
        line["input"] = args.input
        line["longest"] = [
            {**r, "jct_s_elsewhere": {o: by[o][r["id"]]["jct_s"] for o in policies
                                      if o != policy and r["id"] in by[o]}}
            for r in top[: args.show]
        ]
        print(json.dumps(line))
    if len(policies) > 1:
        ids = {p: {r["id"] for r in tails[p][1]} for p in policies}
        print(json.dumps({
            "input": args.input,
            "tail_only_in": {p: len(ids[p] - set.union(*(ids[o] for o in policies if o != p)))
                             for p in policies},
            "tail_in_all": len(set.intersection(*ids.values())),
            "jobs": len(by[policies[0]]),
            "p99_ratio": {p: round(tails[p][0] / tails[policies[-1]][0], 4) if tails[policies[-1]][0]
                          else math.nan for p in policies},
        }))


if __name__ == "__main__":
    main()
