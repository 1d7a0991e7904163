"""Policy quality on real traces: one JSON line per trace and policy, with the
targets of issue 14 checked on mlwe's line (figures, not tests).

    .venv/bin/python benchmarks/policy_quality.py [--inputs NAME,...] [--checkpoint MODEL]

Inputs (all by default; the full Philly trace is slow, ask for it by name):
  philly-3000     philly --limit 3000 --cluster nodes:16x8
  philly-5000     philly --limit 5000 --cluster nodes:32x8
  philly-full     the whole trace on 8-GPU nodes sized to ~90% offered load
  itp:01..itp:05  ITP clusters at the loader's sizing (deadlines)
  synthetic       the synthetic mix (deadline-met ratio)
  authors-5000    the first 5,000 ROWS of philly/jobs.csv (file order), sorted by
                  submit, on pooled:256: tiresias-free and srtf-free against the
                  Tiresias authors' simulator (13,747 s and 13,543.57 s)

Every policy of one input runs on the same trace and cluster in this process,
under the same checkpoint model (a "-free" baseline forces its own), like one
`mlwe compare` run. mlwe's line carries "targets": each with the figure, the
bound and whether it is met.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import tempfile
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from mlwe.sim.baselines import ORACLE_POLICIES
from mlwe.sim.checkpoint import CheckpointModel, parse_checkpoint_model
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import Trace, load_trace, resolve_traces_dir

PHILLY_POLICIES = ["mlwe", "fifo-backfill", "tiresias", "sjf", "srtf"]
ITP_POLICIES = ["mlwe", "fifo-backfill", "tiresias", "edf", "sjf"]
AUTHORS = {"tiresias-free": 13_747.0, "srtf-free": 13_543.57}
KEYS = (
    "jobs", "completed", "avg_jct_s", "median_jct_s", "p99_jct_s", "avg_bounded_slowdown",
    "p99_bounded_slowdown", "max_bounded_slowdown", "avg_queue_delay_s",
    "max_queue_delay_s", "gpu_util", "deadline_met_ratio", "preemptions",
    "gpu_hours_lost_to_preemption", "estimate_p50_rel_error", "estimate_p90_rel_error",
    "estimate_coverage", "checkpoint_model", "placement", "wall_s", "jobs_per_s",
    "invariants",
)


def _authors_csv(rows: int) -> Path:
    """The first ``rows`` rows of philly/jobs.csv in file order, as a generic CSV."""
    src = resolve_traces_dir(None) / "philly" / "jobs.csv"
    out = Path(tempfile.gettempdir()) / f"mlwe-philly-first-{rows}-rows.csv"
    with src.open(newline="") as f, out.open("w", newline="") as g:
        w = csv.writer(g)
        w.writerow(["job_id", "submit_time", "duration", "num_gpu", "queue"])
        for i, row in enumerate(csv.DictReader(f)):
            if i >= rows:
                break
            t = datetime.strptime(row["timestamp"], "%Y-%m-%d %H:%M:%S").replace(tzinfo=UTC)
            w.writerow([f"philly-row-{i + 2}", int(t.timestamp()), row["duration"],
                        row["num_gpus"], "vc-" + row["cluster"]])
    return out


def _philly_90() -> Trace:
    """The whole Philly trace on 8-GPU nodes: offered load ~90% of capacity."""
    tr = load_trace("philly")
    span = max(j.submit_time for j in tr.jobs) - min(j.submit_time for j in tr.jobs)
    gpu_s = sum(j.duration * j.spec.resources.gpu * j.spec.replicas / 1000 for j in tr.jobs)
    nodes = max(16, math.ceil(gpu_s / span / 0.9 / 8))
    return load_trace("philly", cluster=f"nodes:{nodes}x8")


INPUTS: dict[str, tuple[Callable[[], Trace], list[str], str]] = {
    "philly-3000": (lambda: load_trace("philly", limit=3000, cluster="nodes:16x8"),
                    PHILLY_POLICIES, "philly"),
    "philly-5000": (lambda: load_trace("philly", limit=5000, cluster="nodes:32x8"),
                    PHILLY_POLICIES, "philly"),
    "philly-full": (_philly_90, ["mlwe", "fifo-backfill", "tiresias"], "philly"),
    **{
        f"itp:0{i}": (lambda i=i: load_trace(f"itp:0{i}"), ITP_POLICIES, "itp")  # type: ignore[misc]
        for i in range(1, 6)
    },
    "synthetic": (lambda: load_trace("synthetic", limit=1000), ["mlwe", "edf", "tiresias"],
                  "synthetic"),
    "authors-5000": (lambda: load_trace(str(_authors_csv(5000)), cluster="pooled:256"),
                     ["tiresias-free", "srtf-free", "tiresias", "mlwe"], "authors"),
}
DEFAULT = [k for k in INPUTS if k != "philly-full"]


def _target(value: Any, bound: Any, ok: bool) -> dict[str, Any]:
    return {"value": value, "bound": bound, "met": bool(ok)}


#: mlwe's own policies: never a baseline of another's targets
OURS = frozenset({"mlwe", "mlwe-drain", "mlwe-rewait", "variant"})


def targets(kind: str, by: dict[str, dict[str, Any]], candidate: str = "mlwe") -> dict[str, Any]:
    """The issue-14 targets of ``candidate``'s line (mlwe's, or a variant's) against
    the baselines of the same run (every other policy that is not one of ours)."""
    m = by.get(candidate)
    by = {p: x for p, x in by.items() if p not in OURS}
    out: dict[str, Any] = {}
    if m is None or (not by and kind != "synthetic"):
        return out  # targets compare the candidate with baselines of the same run
    if kind == "philly":
        honest = {p: x for p, x in by.items() if p not in ORACLE_POLICIES}
        best = min(honest.values(), key=lambda x: x["avg_jct_s"])
        bound = 0.9 * best["avg_jct_s"]
        out["avg_jct_le_0.9x_best_non_oracle"] = _target(
            m["avg_jct_s"], round(bound, 1), m["avg_jct_s"] <= bound
        ) | {"best": best["policy"]}
        fb = by.get("fifo-backfill")
        if fb:
            out["p99_jct_le_fifo_backfill"] = _target(
                m["p99_jct_s"], fb["p99_jct_s"], m["p99_jct_s"] <= fb["p99_jct_s"]
            )
        t = by.get("tiresias")
        if t:
            half = t["gpu_hours_lost_to_preemption"] / 2
            out["lost_gpu_h_le_half_tiresias"] = _target(
                m["gpu_hours_lost_to_preemption"], half, m["gpu_hours_lost_to_preemption"] <= half
            )
        out["jobs_per_s_ge_1000"] = _target(m["jobs_per_s"], 1000, (m["jobs_per_s"] or 0) >= 1000)
    elif kind == "itp":
        others = list(by.values())
        best = max(others, key=lambda x: x["deadline_met_ratio"] or 0.0)
        bound = (best["deadline_met_ratio"] or 0.0) + 0.03
        out["deadline_met_ge_best_plus_0.03"] = _target(
            m["deadline_met_ratio"], round(bound, 6), (m["deadline_met_ratio"] or 0) >= bound
        ) | {"best": best["policy"]}
        e = by.get("edf")
        if e:
            out["avg_jct_le_edf"] = _target(m["avg_jct_s"], e["avg_jct_s"],
                                            m["avg_jct_s"] <= e["avg_jct_s"])
    elif kind == "synthetic":
        out["deadline_met_ge_0.98"] = _target(
            m["deadline_met_ratio"], 0.98, (m["deadline_met_ratio"] or 0) >= 0.98
        )
    return out


def run_policies(
    trace: Trace, policies: list[str], model: CheckpointModel
) -> dict[str, dict[str, Any]]:
    """Each policy replayed on ``trace`` under ``model``: its line of figures (KEYS)."""
    by: dict[str, dict[str, Any]] = {}
    for policy in policies:
        m = replay(trace, ReplayConfig(policy=policy, checkpoint=model)).metrics
        by[policy] = {"policy": policy, **{k: m.get(k) for k in KEYS}}
    return by


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", default=",".join(DEFAULT))
    ap.add_argument("--policies", default="", help="override the policies of every input")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    args = ap.parse_args()
    model = parse_checkpoint_model(args.checkpoint)
    for name in [x.strip() for x in args.inputs.split(",") if x.strip()]:
        if name not in INPUTS:
            sys.exit(f"unknown input {name!r}; known: {', '.join(INPUTS)}")
        load, policies, kind = INPUTS[name]
        if args.policies:
            policies = [p.strip() for p in args.policies.split(",") if p.strip()]
        trace = load()
        by = run_policies(trace, policies, model)
        extra = targets(kind, by)
        for policy, line in by.items():
            row: dict[str, Any] = {"input": name, "trace": trace.name, **line}
            if policy == "mlwe" and extra:
                row["targets"] = extra
            if kind == "authors" and policy in AUTHORS:
                ref = AUTHORS[policy]
                row["targets"] = {"avg_jct_within_5pct_of_authors": _target(
                    line["avg_jct_s"], ref, abs(line["avg_jct_s"] - ref) <= 0.05 * ref
                ) | {"ratio": round(line["avg_jct_s"] / ref, 4)}}
            print(json.dumps(row, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
