"""How much of a policy comparison is chance: the inputs of ``policy_quality.py``
replayed under small seeded perturbations of their arrivals.

    .venv/bin/python benchmarks/policy_noise.py [--inputs philly-3000] [--replicas 8]
        [--jitter 1] [--policies mlwe,tiresias,fifo-backfill] [--checkpoint MODEL]
        [--variant FILE:FUNCTION --candidate variant]

Replica 0 is the input as it is (its lines are ``policy_quality.py``'s); replica k
submits every job a uniform [0, ``--jitter``) seconds later, seeded by k
(:func:`mlwe.sim.traces.jitter_submits`), and every policy of one replica runs on
the same perturbed trace, under the same checkpoint model. A contended replay is
chaotic: one job arriving a fraction of a second later changes which job a freed
node goes to, and that choice cascades. A change to a policy is a real gain only
where it exceeds this spread; a target missed (or met) by less than the spread is
decided by chance.

Prints one JSON line per replica and policy (the figures of ``policy_quality.py``),
then one summary line per input: for each policy and each of avg JCT, p99 JCT,
GPU-hours lost and preemptions, the min, median and max over the replicas and the
relative spread ((max - min) / median); and for each issue-14 target on the
candidate's lines (``--candidate``: mlwe, or ``variant`` to judge a change against
the same baselines; mlwe's own policies are never its baselines), in how many
replicas it is met, with the ratio of its figure to the bound (min, median, max).
Figures, not tests; the same arguments print the same lines.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_quality import INPUTS, run_policies, targets
from policy_windows import load_variant

from mlwe.sim.checkpoint import parse_checkpoint_model
from mlwe.sim.traces import jitter_submits

#: the figures whose spread the summary gives
SPREAD = ("avg_jct_s", "p99_jct_s", "gpu_hours_lost_to_preemption", "preemptions")


def spread(values: list[float]) -> dict[str, float | None]:
    """Min, median and max of ``values``, and (max - min) / median."""
    lo, mid, hi = min(values), statistics.median(values), max(values)
    return {"min": lo, "median": mid, "max": hi,
            "rel_spread": round((hi - lo) / mid, 4) if mid else None}


def summarise(name: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The spread of each policy's figures, and how often each target is met."""
    out: dict[str, Any] = {"summary": name, "replicas": len({r["replica"] for r in rows})}
    for policy in dict.fromkeys(r["policy"] for r in rows):
        mine = [r for r in rows if r["policy"] == policy]
        out[policy] = {k: spread([float(r[k] or 0.0) for r in mine]) for k in SPREAD}
    met: dict[str, Any] = {}
    for r in rows:
        for target, t in r.get("targets", {}).items():
            m = met.setdefault(target, {"met": 0, "of": 0, "ratios": []})
            m["of"] += 1
            m["met"] += bool(t["met"])
            if isinstance(t["bound"], int | float) and t["bound"]:
                m["ratios"].append(t["value"] / t["bound"])
    for m in met.values():
        ratios = m.pop("ratios")
        if ratios:
            m["value_over_bound"] = {k: round(v, 4) for k, v in spread(ratios).items()
                                     if k != "rel_spread" and v is not None}
    out["targets"] = met
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--inputs", default="philly-3000")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--jitter", type=float, default=1.0,
                    help="seconds: each job arrives a uniform [0, J) later")
    ap.add_argument("--policies", default="mlwe,tiresias,fifo-backfill")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    ap.add_argument("--variant", default=None, help="FILE:FUNCTION, added as policy 'variant'")
    ap.add_argument("--candidate", default="mlwe",
                    help="the policy whose targets are counted (e.g. variant)")
    args = ap.parse_args()
    if args.replicas < 1:
        sys.exit("--replicas must be at least 1")
    if args.variant:
        load_variant(args.variant)
    model = parse_checkpoint_model(args.checkpoint)
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    for name in [x.strip() for x in args.inputs.split(",") if x.strip()]:
        if name not in INPUTS:
            sys.exit(f"unknown input {name!r}; known: {', '.join(INPUTS)}")
        load, _, kind = INPUTS[name]
        base = load()
        rows: list[dict[str, Any]] = []
        for k in range(args.replicas):
            trace = jitter_submits(base, args.jitter if k else 0.0, seed=k)
            by = run_policies(trace, policies, model)
            extra = targets(kind, by, args.candidate)
            for policy, line in by.items():
                row: dict[str, Any] = {"input": name, "replica": k, "jitter_s": args.jitter
                                       if k else 0.0, "trace": trace.name, **line}
                if policy == args.candidate and extra:
                    # the speed target is measured by policy_quality.py, alone
                    row["targets"] = {t: v for t, v in extra.items() if t != "jobs_per_s_ge_1000"}
                rows.append(row)
                print(json.dumps(row, sort_keys=True), flush=True)
        print(json.dumps(summarise(name, rows), sort_keys=True), flush=True)


if __name__ == "__main__":
    main()
