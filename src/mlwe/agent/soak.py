"""The soak: N deliberations of a reasoner through the real agent loop, measured.

It runs the scenario worlds (:mod:`mlwe.agent.scenarios`: real control plane,
scheduler, reconciler, what-if forecaster and workflows on the simulator) one
after another, round-robin, the seed rising each cycle, until the reasoner has
deliberated ``n`` times (a deliberation: one ``choose`` call, i.e. one
conversation with the model). The run in which the budget is spent goes on to
its horizon with the agent deciding nothing more, so every run's KPIs can be
compared with the same world without the agent (same seed). It reports:

- deliberations, and their latency (the reasoner's own time: the model
  conversation) p50/p95/max, next to the loop's whole deliberation (with the
  forecast) p50/p95;
- proposals made (a deliberation that chose a plan, a candidate or the
  model's own), accepted by the control plane, and the others by outcome and
  by reason (reasons with their ids and numbers taken out, so alike ones add up);
- tool calls the guardrail refused, by reason; deliberations that failed
  (endpoint error, timeout, unusable answer) and what became of them;
- invariant checks: the control plane's full ``validate_state`` after every
  agent round, and an independent check of every accepted proposal (every
  workload and node it names existed, and a preemption's victim had a strictly
  lower priority than its preemptor): ``invalid_accepted`` counts the
  accepted proposals that failed either. The claim is that it stays 0;
- the KPI effect against doing nothing: each run's KPIs minus the baseline's,
  and the scenarios' expectations passed.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.loop import Agent
from mlwe.agent.metered import BUDGET_SPENT, MeteredReasoner, reason_class
from mlwe.agent.reasoners.base import Reasoner
from mlwe.agent.scenarios import SCENARIOS, check_scenarios, run_world
from mlwe.core.controlplane import ControlPlane


def _pct(xs: Sequence[float], q: float) -> float:
    s = sorted(xs)
    return round(s[min(len(s) - 1, int(q * len(s)))], 1) if s else 0.0


@dataclass
class Checks:
    """Invariant checks made after every agent round of one run."""

    rounds: int = 0
    violations: list[str] = field(default_factory=list)
    accepted_checked: int = 0
    invalid_accepted: list[str] = field(default_factory=list)
    _seen: int = 0  # audit records already looked at

    def after_round(self, cp: ControlPlane, agent: Agent) -> None:
        self.rounds += 1
        self.violations += [str(v) for v in cp.validate_state()]
        audit = list(agent.audit)
        new, self._seen = audit[self._seen:], len(audit)
        for rec in new:
            if rec.get("step") == "proposal" and rec.get("accepted"):
                self.accepted_checked += 1
                bad = independent_check(cp, rec.get("actions") or [])
                if bad:
                    self.invalid_accepted.append(f"{rec.get('correlation_id')}: {'; '.join(bad)}")


def independent_check(cp: ControlPlane, actions: Sequence[dict[str, Any]]) -> list[str]:
    """What is wrong with an accepted batch, checked apart from the control plane's own
    verification: names that do not exist, a preemption against the priority rule."""
    bad: list[str] = []
    created = {a.get("spec", {}).get("id") for a in actions if a.get("kind") == "submit"}
    for a in actions:
        for key in ("workload", "victim", "preemptor"):
            wid = a.get(key)
            if wid is not None and wid not in cp.workloads and wid not in created:
                bad.append(f"{a.get('kind')}: unknown workload {wid!r}")
        node = a.get("node")
        if node is not None and node not in set(cp.capacity.node_names()):
            bad.append(f"{a.get('kind')}: unknown node {node!r}")
        if a.get("kind") == "preempt":
            v, p = cp.workloads.get(a.get("victim", "")), cp.workloads.get(a.get("preemptor", ""))
            if v is not None and p is not None and not v.priority < p.priority:
                bad.append(f"preempt: victim {v.id} (priority {v.priority}) is not below"
                           f" preemptor {p.id} (priority {p.priority})")
    return bad


@dataclass
class _Tally:
    """What became of the deliberations' proposals, over every run of a soak."""

    outcomes: Counter[str] = field(default_factory=Counter)
    rejected_by_reason: Counter[str] = field(default_factory=Counter)
    refused_by_reason: Counter[str] = field(default_factory=Counter)
    fallbacks: int = 0
    proposals: int = 0
    accepted: int = 0

    def count(self, records: Sequence[dict[str, Any]]) -> None:
        """One run's reasoning records (those made after the budget was spent left out)."""
        for rec in records:
            trace = rec.get("trace") or {}
            if BUDGET_SPENT in (trace.get("why") or ()):
                continue
            outcome = rec["outcome"]
            self.outcomes[outcome] += 1
            if str(trace.get("reasoner", "")).startswith("rules (fallback"):
                self.fallbacks += 1
            if trace.get("chose", "nothing") != "nothing":
                self.proposals += 1
                if outcome == "committed":
                    self.accepted += 1
                elif outcome in ("not-verified", "rejected", "stale"):
                    for r in rec.get("reasons") or ():
                        self.rejected_by_reason[reason_class(r)] += 1
            for call in trace.get("tool_calls") or ():
                summary = str(call.get("summary", ""))
                if summary.startswith("refused by the guardrail"):
                    self.refused_by_reason[reason_class(summary)] += 1


def _run_figures(sc: Any, name: str, run_seed: int, deliberations: int, world: Any,
                 base: Any) -> dict[str, Any]:
    """One scenario run: its expectations met, and its KPIs against doing nothing."""
    expectations = sc.expect(world, base)
    a_kpi, b_kpi = sc.kpis(world), sc.kpis(base)
    return {
        "scenario": name,
        "seed": run_seed,
        "deliberations": deliberations,
        "committed": world.committed(),
        "passed": sum(1 for _, ok, _ in expectations if ok),
        "expectations": len(expectations),
        "kpis": a_kpi,
        "baseline": b_kpi,
        "delta": {k: round(a_kpi[k] - b_kpi[k], 3) for k in a_kpi if k in b_kpi},
    }


def _deltas(runs: list[dict[str, Any]]) -> dict[str, float]:
    """Each KPI's change against doing nothing, summed over the runs."""
    deltas: dict[str, float] = {}
    for r in runs:
        for k, v in r["delta"].items():
            deltas[k] = round(deltas.get(k, 0.0) + v, 3)
    return deltas


def soak(
    reasoner: Reasoner,
    n: int,
    *,
    scenarios: list[str] | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """``n`` deliberations of ``reasoner`` through the agent loop; the figures above."""
    if n < 1:
        raise ValueError("n (deliberations) must be at least 1")
    chosen = check_scenarios(scenarios)
    metered = MeteredReasoner(reasoner, n)
    tally = _Tally()
    checks_total = Checks()
    runs: list[dict[str, Any]] = []
    think_ms: list[float] = []
    t0 = time.perf_counter()
    cycle = 0
    while not metered.spent:
        before_cycle = metered.deliberations
        for name in chosen:
            if metered.spent:
                break
            sc = SCENARIOS[name]()
            run_seed = seed + cycle
            checks = Checks()
            before = metered.deliberations
            world = run_world(sc, with_agent=True, reasoner=metered, seed=run_seed,
                              after_tick=checks.after_round)
            base = run_world(sc, with_agent=False, seed=run_seed)
            agent = world.agent
            assert agent is not None
            tally.count(agent.records)
            think_ms += list(agent.stats.think_ms)
            checks_total.rounds += checks.rounds
            checks_total.violations += checks.violations
            checks_total.accepted_checked += checks.accepted_checked
            checks_total.invalid_accepted += checks.invalid_accepted
            runs.append(_run_figures(sc, name, run_seed, metered.deliberations - before, world, base))
            if progress is not None:
                progress(f"{name} seed {run_seed}: {metered.deliberations}/{n} deliberations,"
                         f" committed {world.committed() or '-'}")
        cycle += 1
        if metered.deliberations == before_cycle:  # the worlds raise no finding at all
            break
    deltas = _deltas(runs)
    lat = metered.latency_ms
    return {
        "reasoner": reasoner.name,
        "model": getattr(reasoner, "model", None),
        "on_failure": getattr(reasoner, "on_failure", None),
        "deliberations": metered.deliberations,
        "latency_ms": {"p50": _pct(lat, 0.5), "p95": _pct(lat, 0.95),
                       "max": round(max(lat), 1) if lat else 0.0},
        "deliberation_with_forecast_ms": {"p50": _pct(think_ms, 0.5),
                                          "p95": _pct(think_ms, 0.95)},
        "proposals": tally.proposals,
        "accepted": tally.accepted,
        "rejected": tally.proposals - tally.accepted,
        "outcomes": dict(sorted(tally.outcomes.items())),
        "rejected_by_reason": dict(tally.rejected_by_reason.most_common()),
        "refused_tool_calls_by_reason": dict(tally.refused_by_reason.most_common()),
        "failed_deliberations": dict(metered.errors.most_common()),
        "fallbacks_to_rules": tally.fallbacks,
        "invariant_checks": checks_total.rounds,
        "invariant_violations": checks_total.violations,
        "accepted_checked": checks_total.accepted_checked,
        "invalid_accepted": len(checks_total.invalid_accepted),
        "invalid_accepted_detail": checks_total.invalid_accepted,
        "kpi_effect": {
            "runs": len(runs),
            "expectations_passed": sum(r["passed"] for r in runs),
            "expectations": sum(r["expectations"] for r in runs),
            "delta_vs_doing_nothing": deltas,
        },
        "runs": runs,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
