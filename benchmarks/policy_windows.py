"""A policy across many windows of the Philly trace, not two fixed inputs.

    .venv/bin/python benchmarks/policy_windows.py [--windows 8] [--jobs 3000]
        [--load L] [--policies mlwe,tiresias,fifo-backfill] [--variant FILE:FUNCTION]

On the two fixed contended inputs of ``policy_quality.py`` the default policy's
figures move by 1-8% under any small change (a tie-break, a bound, a weight),
in either direction, and differently on each input: a change that wins on one
loses on the other. A variant is worth keeping only if it wins on most of many
inputs. This benchmark cuts ``--windows`` windows of ``--jobs`` consecutive jobs
(in submit order) at evenly spaced offsets through the whole trace, sizes a
cluster of 8-GPU nodes for each so that every window sees the same offered load
(``--load``: GPU-seconds asked / GPU-seconds the cluster has over the window's
arrival span; the default is that of ``philly-3000`` on ``nodes:16x8``), and
replays every policy on each window under the same checkpoint model.

``--variant FILE:FUNCTION`` adds a policy named "variant": FUNCTION(durations,
**options) in FILE must return a Scheduler (as the factories of
``mlwe.sim.baselines.POLICIES`` do), e.g. the default with one rule changed.

Prints one JSON line per window and policy (avg and p99 JCT, p99 and max bounded
slowdown, preemptions, GPU hours lost), then one summary line per policy: over the
windows, the geometric mean of its avg and p99 JCT and p99 bounded slowdown
relative to the first policy of ``--policies``, the
worst and best window ratios, and in how many windows it is the lowest. Figures,
not tests; the replays are deterministic, so two runs print the same lines.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import math
from dataclasses import replace
from typing import Any

from mlwe.core import ClusterSpec
from mlwe.sim import baselines
from mlwe.sim.checkpoint import parse_checkpoint_model
from mlwe.sim.replay import ReplayConfig, replay
from mlwe.sim.traces import Trace, load_trace

GPUS_PER_NODE = 8
#: compared across windows: the two JCT figures the issue sets targets on, and the
#: tail of bounded slowdown (short jobs left waiting, which a JCT percentile hides)
METRICS = ("avg_jct_s", "p99_jct_s", "p99_bounded_slowdown")


def gpu_seconds(tr: Trace) -> float:
    return sum(j.duration * j.spec.resources.gpu * j.spec.replicas / 1000 for j in tr.jobs)


def offered_load(tr: Trace, gpus: int) -> float:
    """GPU-seconds asked / GPU-seconds ``gpus`` GPUs give over the arrival span."""
    span = max(j.submit_time for j in tr.jobs) - min(j.submit_time for j in tr.jobs)
    return gpu_seconds(tr) / (max(span, 1.0) * gpus)


@functools.cache
def _cluster(nodes: int) -> ClusterSpec:
    """``nodes`` 8-GPU nodes with the queues of the whole trace (as the loader builds it)."""
    return load_trace("philly", cluster=f"nodes:{nodes}x{GPUS_PER_NODE}").cluster


def windows(full: Trace, count: int, jobs: int, load: float) -> list[tuple[int, Trace]]:
    """``count`` windows of ``jobs`` consecutive jobs at evenly spaced offsets, each
    on 8-GPU nodes sized to offered load ``load`` (at least one node, and at least
    as many GPUs as the window's largest job asks)."""
    n = len(full.jobs)
    if jobs > n:
        raise SystemExit(f"--jobs {jobs}: the trace has {n} jobs")
    step = (n - jobs) // max(count - 1, 1) if count > 1 else 0
    out = []
    for i in range(count):
        start = i * step
        part = replace(full, name=f"{full.name}[{start}:{start + jobs}]",
                       jobs=full.jobs[start:start + jobs])
        biggest = max(j.spec.resources.gpu * j.spec.replicas // 1000 for j in part.jobs)
        # offered load on one node / the load asked for = the nodes that give that load
        nodes = max(1, math.ceil(offered_load(part, GPUS_PER_NODE) / load),
                    math.ceil(biggest / GPUS_PER_NODE))
        out.append((start, replace(part, cluster=_cluster(nodes))))
    return out


def load_variant(arg: str) -> None:
    """Register FUNCTION of FILE as the policy "variant"."""
    path, _, func = arg.rpartition(":")
    if not path or not func:
        raise SystemExit(f"--variant {arg!r}: expected FILE:FUNCTION")
    spec = importlib.util.spec_from_file_location("mlwe_policy_variant", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--variant {arg!r}: cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    baselines.POLICIES["variant"] = getattr(module, func)


def summary(policies: list[str], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per policy: geometric mean, worst and best of its per-window ratios to the
    first policy, and the windows where it is the lowest, for each of :data:`METRICS`."""
    by_window: dict[int, dict[str, dict[str, Any]]] = {}
    for r in rows:
        by_window.setdefault(r["start"], {})[r["policy"]] = r
    ref = policies[0]
    out = []
    for p in policies:
        line: dict[str, Any] = {"summary": p, "relative_to": ref, "windows": len(by_window)}
        for metric in METRICS:
            ratios = [w[p][metric] / w[ref][metric] for w in by_window.values()
                      if w[ref][metric]]
            line[f"{metric}_geomean_ratio"] = round(
                math.exp(sum(map(math.log, ratios)) / len(ratios)), 4) if ratios else None
            line[f"{metric}_worst_ratio"] = round(max(ratios), 4) if ratios else None
            line[f"{metric}_best_ratio"] = round(min(ratios), 4) if ratios else None
            line[f"{metric}_lowest_in"] = sum(
                1 for w in by_window.values()
                if w[p][metric] <= min(x[metric] for x in w.values())
            )
        out.append(line)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--jobs", type=int, default=3000)
    ap.add_argument("--load", type=float, default=None,
                    help="offered load of every window (default: philly-3000 on nodes:16x8)")
    ap.add_argument("--policies", default="mlwe,tiresias,fifo-backfill")
    ap.add_argument("--variant", default=None, help="FILE:FUNCTION, added as policy 'variant'")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    args = ap.parse_args()
    if args.windows < 1 or args.jobs < 2:
        raise SystemExit("--windows must be >= 1 and --jobs >= 2")
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    if args.variant:
        load_variant(args.variant)
        if "variant" not in policies:
            policies.append("variant")
    for p in policies:
        if p not in baselines.POLICIES:
            raise SystemExit(f"unknown policy {p!r}; known: {', '.join(baselines.POLICIES)}")
    load = args.load
    if load is None:
        load = offered_load(load_trace("philly", limit=3000), 16 * GPUS_PER_NODE)
    if not (math.isfinite(load) and load > 0):
        raise SystemExit(f"--load {load}: must be a positive number")
    model = parse_checkpoint_model(args.checkpoint)
    rows: list[dict[str, Any]] = []
    for start, tr in windows(load_trace("philly"), args.windows, args.jobs, load):
        for p in policies:
            m = replay(tr, ReplayConfig(policy=p, checkpoint=model)).metrics
            nodes = len(tr.cluster.nodes)
            row = {"start": start, "jobs": args.jobs, "nodes": nodes,
                   "offered_load": round(offered_load(tr, nodes * GPUS_PER_NODE), 4), "policy": p,
                   **{k: m.get(k) for k in (*METRICS, "max_bounded_slowdown", "preemptions",
                                            "gpu_hours_lost_to_preemption", "completed")}}
            rows.append(row)
            print(json.dumps(row, sort_keys=True), flush=True)
    for line in summary(policies, rows):
        print(json.dumps(line, sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
