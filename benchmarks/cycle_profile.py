"""Where a replay's scheduling cycles spend their time, phase by phase, with counts.

    .venv/bin/python benchmarks/cycle_profile.py [--input philly-5000] [--policy mlwe] [--ceilings]

Replays one input of ``policy_quality.py`` (same trace, cluster and checkpoint
model) and prints one JSON line:

- cycles by what triggered them (an arrival, a requeue, a release of held
  resources, the scheduler's own wake time; several when they came together),
  each with how many decided nothing (``idle``: no action) and the CPU they took:
  where a cheaper cycle would pay off most;
- counts, which are deterministic (they depend only on the decisions): cycles,
  turns taken and turns skipped (by the early stop, or passed over as unable
  to fit once only a fit could start anything), head projections (and how
  many reused the cached one), gain tests, gain searches run, victim searches
  and the nodes they examined, decisions by kind;
- CPU seconds by phase, each exclusive of the phases it calls: ordering the
  queue, projecting the head's reservation, the gain test (``could_gain`` and
  its pool), victim searches, fits, the rest of planning (turns, waits,
  records), the control plane's applies (plans, submissions, backend facts)
  and everything else (kernel, simulated backend, metrics);
  with the share of the replay's CPU each takes.

The timers wrap the phases' functions, so the whole run is slower than a plain
replay (the ``overhead`` line says by about how much); compare shares, and
compare counts between commits (a change meant only to be faster leaves every
count equal). This is the profile the issue asks for in a note: run it before
and after a change to the cycle.

``--ceilings`` adds counts that bound what keeping each holder's expected end
across cycles (instead of reading it anew at every cycle) could save, as a
``ceilings`` object:

- per gain test computed (``could_gain`` run: the ``gain_tests`` of the counts
  include those a remembered miss answered), the holders it reads (those on the
  nodes where victims could make room, not yet taken) and how many of them are
  expected to run at least the test's floor (``gain_ratio`` x the preemptor's
  expected run): a structure ordered by expected end could skip the rest unread,
  never these; and the tests where none reaches the floor (answered without
  reading any holder);
- per head projection computed, the holders whose ends it reads and the ends it
  pops before the head fits (what reading the ends in order would read).

Counting reads each holder's expected remaining time before the test does (the
cycle's memo then answers the test), so phase timings move between the gain
test and the counting: compare counts, not times, in such a run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from policy_quality import INPUTS

from mlwe.core import controlplane, gain, reconcile, scheduler
from mlwe.core.policies import deadline, preemption
from mlwe.sim import driver
from mlwe.sim.checkpoint import parse_checkpoint_model
from mlwe.sim.replay import ReplayConfig, replay

#: phase -> (owner, attribute): the functions timed (exclusive of the phases they call)
PHASES: dict[str, tuple[Any, str]] = {
    "order": (scheduler.Scheduler, "_snapshot"),
    "project_head": (scheduler.Scheduler, "_reserve"),
    "gain_test": (scheduler.Scheduler, "_could_gain"),
    "victim_search": (preemption.CheapestVictims, "select"),
    "fit": (scheduler.Scheduler, "_try_fit"),
    # every batch the control plane applies: plans, submissions, backend facts
    "control_plane_apply": (controlplane.ControlPlane, "apply"),
    "rest_of_planning": (scheduler.Scheduler, "plan"),
}


class Timers:
    """Exclusive CPU per phase: a phase's time minus that of the phases it calls."""

    def __init__(self) -> None:
        self.spent: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self._stack: list[list[float]] = []  # [start, time spent in inner phases]

    def wrap(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        clock, stack, spent, calls = time.process_time, self._stack, self.spent, self.calls

        def timed(*args: Any, **kw: Any) -> Any:
            frame = [clock(), 0.0]
            stack.append(frame)
            try:
                return fn(*args, **kw)
            finally:
                stack.pop()
                took = clock() - frame[0]
                spent[phase] += took - frame[1]
                calls[phase] += 1
                if stack:
                    stack[-1][1] += took

        return timed


def _note_triggers(patch: Callable[[Any, str, Any], None]) -> set[str]:
    """The triggers of the next cycle, as they come: each transition's
    :func:`mlwe.core.reconcile.cycle_trigger` (the reconciler's own rule) and the
    driver's wake at the scheduler's own moment ("wake")."""
    triggers: set[str] = set()
    rule = reconcile.cycle_trigger

    def noting(tr: Any) -> str | None:
        why = rule(tr)
        if why is not None:
            triggers.add(why)
        return why

    patch(reconcile, "cycle_trigger", noting)
    wake = driver.Driver._wake

    def woken(self: driver.Driver, arg: Any) -> None:
        triggers.add("wake")
        wake(self, arg)

    patch(driver.Driver, "_wake", woken)
    return triggers


def _count_ceilings(patch: Callable[[Any, str, Any], None], ceilings: Counter[str]) -> None:
    """Count, alongside the replay, what bounds an incremental holder-end structure's
    savings (see the module's ``--ceilings``)."""
    test = scheduler.could_gain

    def counted_test(
        cfg: Any, remaining: Any, w: Any, shape: Any, fork: Any, nodes: Any, taken: Any,
        exclude: Any, pool: Any, now: float, *rest: Any, **kw: Any,
    ) -> Any:
        floor = cfg.gain_ratio * gain.expected_left(remaining, w, now, cfg.gain_prior_s)
        read = [x for x in pool.viable(shape.gpu, nodes, exclude, fork) if x not in taken]
        above = sum(1 for x in read if pool.left_of(x) >= floor)
        ceilings["gain_tests_computed"] += 1
        ceilings["gain_test_holders_read"] += len(read)
        ceilings["gain_test_holders_at_or_above_floor"] += above
        ceilings["gain_tests_with_none_at_or_above_floor"] += not above
        return test(cfg, remaining, w, shape, fork, nodes, taken, exclude, pool, now, *rest, **kw)

    patch(scheduler, "could_gain", counted_test)
    ends = deadline.__dict__["_holder_ends"]

    def counted_ends(*args: Any) -> Any:
        heap, assumed = ends(*args)
        ceilings["projections_computed"] += 1
        ceilings["projection_holders_read"] += len(heap)
        return heap, assumed

    patch(deadline, "_holder_ends", counted_ends)
    heapq = deadline.heapq

    class CountedHeap:
        """The projection's heapq, counting its pops (the ends read in order)."""

        heapify, heappush = staticmethod(heapq.heapify), staticmethod(heapq.heappush)

        @staticmethod
        def heappop(heap: list[Any]) -> Any:
            ceilings["projection_ends_popped"] += 1
            return heapq.heappop(heap)

    patch(deadline, "heapq", CountedHeap)


def profile(name: str, policy: str, checkpoint: str, ceilings: bool = False) -> dict[str, Any]:
    load, _, _ = INPUTS[name]
    trace = load()
    timers = Timers()
    counts: Counter[str] = Counter()
    saved: list[tuple[Any, str, Any]] = []

    def patch(owner: Any, attr: str, new: Any) -> None:
        saved.append((owner, attr, owner.__dict__[attr]))
        setattr(owner, attr, new)

    for phase, (owner, attr) in PHASES.items():
        patch(owner, attr, timers.wrap(phase, owner.__dict__[attr]))
    plan = scheduler.Scheduler.plan
    triggers = _note_triggers(patch)
    by_trigger: dict[str, Counter[str]] = {}

    def counted_plan(self: scheduler.Scheduler, cp: Any, cause_id: str | None = None) -> Any:
        cached = self._reservation_cache
        row = by_trigger.setdefault("+".join(sorted(triggers)) or "other", Counter())
        triggers.clear()
        t = time.process_time()
        p = plan(self, cp, cause_id)
        took = time.process_time() - t
        row["cycles"] += 1
        row["cpu_s"] += took
        if not p.actions:
            row["idle"] += 1
            row["idle_cpu_s"] += took
        counts["cycles"] += 1
        counts["turns"] += p.considered
        counts["turns_skipped_by_early_stop"] += p.stopped_early
        counts["queued_at_cycle_start"] += p.considered + p.stopped_early
        if self._reservation_cache is not cached:
            counts["projections_computed"] += 1
        return p

    patch(scheduler.Scheduler, "plan", counted_plan)
    search = preemption.CheapestVictims._search

    def counted_search(self: preemption.CheapestVictims, *args: Any) -> Any:
        before = self._cursor
        got = search(self, *args)
        counts["victim_searches_scanned"] += 1
        counts["victim_nodes_examined"] += self._cursor - before
        return got

    patch(preemption.CheapestVictims, "_search", counted_search)
    choice = gain.gain_choice

    def counted_choice(*args: Any, **kw: Any) -> Any:
        counts["gain_searches"] += 1
        return choice(*args, **kw)

    patch(scheduler, "gain_choice", counted_choice)
    bounds: Counter[str] = Counter()
    if ceilings:
        _count_ceilings(patch, bounds)
    t0 = time.process_time()
    try:
        r = replay(trace, ReplayConfig(policy=policy, checkpoint=parse_checkpoint_model(checkpoint)))
    finally:
        for owner, attr, fn in reversed(saved):
            setattr(owner, attr, fn)
    total = time.process_time() - t0
    scheduled = sum(timers.spent.values())
    spent = dict(timers.spent)
    spent["everything_else"] = total - scheduled
    counts["head_projections"] = timers.calls["project_head"]
    counts["gain_tests"] = timers.calls["gain_test"]
    counts["victim_selects"] = timers.calls["victim_search"]
    out: dict[str, Any] = {
        "input": name,
        "policy": policy,
        "jobs": len(trace.jobs),
        "cpu_s": round(total, 3),
        "avg_jct_s": r.metrics["avg_jct_s"],
        "decisions": r.metrics["decisions"],
        "counts": dict(sorted(counts.items())),
        "cycles_by_trigger": {
            k: {"cycles": row["cycles"], "idle": row["idle"], "cpu_s": round(row["cpu_s"], 3),
                "idle_cpu_s": round(row["idle_cpu_s"], 3)}
            for k, row in sorted(by_trigger.items(), key=lambda x: -x[1]["cpu_s"])
        },
        "cpu_s_by_phase": {k: round(v, 3) for k, v in sorted(spent.items(), key=lambda x: -x[1])},
        "share_by_phase": {k: round(v / total, 3) for k, v in sorted(spent.items(), key=lambda x: -x[1])},
        "overhead": "timers on every phase call: compare shares and counts, not this CPU figure",
    }
    if ceilings:
        out["ceilings"] = dict(sorted(bounds.items()))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--input", default="philly-5000", help=f"one of {', '.join(INPUTS)}")
    ap.add_argument("--policy", default="mlwe")
    ap.add_argument("--checkpoint", default="periodic:1800,cost=0,restart=60")
    ap.add_argument("--ceilings", action="store_true",
                    help="count what an incremental holder-end structure could save at most")
    args = ap.parse_args()
    if args.input not in INPUTS:
        sys.exit(f"unknown input {args.input!r}; known: {', '.join(INPUTS)}")
    print(json.dumps(profile(args.input, args.policy, args.checkpoint, args.ceilings)), flush=True)


if __name__ == "__main__":
    main()
