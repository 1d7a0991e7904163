"""Variants of the default policy that were measured and not adopted, kept so the
README's figures for them can be reproduced (``--variant FILE:FUNCTION`` of
``policy_noise.py`` and ``policy_windows.py``), e.g.

    .venv/bin/python benchmarks/policy_noise.py --inputs philly-3000 --replicas 8 \\
        --policies fifo-backfill,variant --variant benchmarks/policy_variants.py:gain_ratio_3 \\
        --candidate variant

Each function builds the default scheduler, named "variant", with one change.
Two of them change what the engine has no setting for; they wrap an engine
function for the variant's own scheduler only (every other policy of the same
run decides as it always does). Experiments, not features: nothing here is
imported by the engine or its tests.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import mlwe.core.gain as gain
import mlwe.core.scheduler as scheduler
from mlwe.core.policies.ordering import attained
from mlwe.core.scheduler import Scheduler, SchedulerConfig, default_scheduler


def _variant(**changes: Any) -> Scheduler:
    sched = default_scheduler(name="variant")
    sched.config = replace(sched.config, **changes)
    return sched


def gain_ratio_3(durations: Mapping[str, float]) -> Scheduler:
    """A victim among equals must be expected to run 3 times longer than its preemptor (default 2)."""
    return _variant(gain_ratio=3.0)


def gain_ratio_4(durations: Mapping[str, float]) -> Scheduler:
    """The same, 4 times."""
    return _variant(gain_ratio=4.0)


# ---------------------------------------------------------------- slowdown shield
#: the configurations of the shielded variants, by identity, with their threshold
_SHIELDED: dict[int, tuple[SchedulerConfig, float]] = {}
_left_of = gain.GainPool.left_of


def _shielded_left_of(pool: gain.GainPool, wid: str) -> float:
    left = _left_of(pool, wid)
    got = _SHIELDED.get(id(pool._cfg))
    if got is not None and got[0] is pool._cfg and left == left:
        v = pool._holders.members[wid][0]
        now = pool._now
        if now - v.submit_time >= got[1] * max(attained(v, now), 1.0):
            left = pool._left[wid] = math.nan  # NaN: in no victim test
    return left


gain.GainPool.left_of = _shielded_left_of  # type: ignore[method-assign,assignment]


def _shield(s: float) -> Scheduler:
    sched = _variant()
    _SHIELDED[id(sched.config)] = (sched.config, s)
    return sched


def shield_3(durations: Mapping[str, float]) -> Scheduler:
    """An equal whose slowdown so far ((now - submit) / attained service) reaches 3
    is no victim among equals (in the gain pool's searches)."""
    return _shield(3.0)


def shield_4(durations: Mapping[str, float]) -> Scheduler:
    """The same, at 4."""
    return _shield(4.0)


def shield_6(durations: Mapping[str, float]) -> Scheduler:
    """The same, at 6."""
    return _shield(6.0)


# ------------------------------------------------------------ backlog re-wait
#: while a backlog variant plans: its scheduler and control plane, and the
#: queue's expected remaining times (sorted) with their GPU-second prefix sums
_PLANNING: dict[str, Any] = {}
_plan = Scheduler.plan
_victim_rewait = gain.victim_rewait


def _backlog_plan(self: Scheduler, cp: Any, cause_id: str | None = None) -> Any:
    if not getattr(self, "_backlog_variant", False):
        return _plan(self, cp, cause_id)
    _PLANNING.update(sched=self, cp=cp, key=None)
    try:
        return _plan(self, cp, cause_id)
    finally:
        _PLANNING.clear()


def _backlog_rewait(cfg: SchedulerConfig, rewaits: Any, v: Any, now: float) -> float:
    cp = _PLANNING.get("cp")
    if cp is None:
        return _victim_rewait(cfg, rewaits, v, now)
    sched = _PLANNING["sched"]
    if _PLANNING["key"] != (cp.version, now):
        items = sorted(
            (gain.expected_left(sched.remaining, w, now, cfg.gain_prior_s),
             w.spec.resources.gpu * w.spec.replicas / 1000)
            for w in cp.queued_workloads()
        )
        sums, total = [0.0], 0.0
        for r, g in items:
            total += r * g
            sums.append(total)
        _PLANNING.update(key=(cp.version, now), left=[r for r, _ in items], sums=sums,
                         gpus=max(sched.total_gpu(cp), 1))
    r_v = gain.expected_left(sched.remaining, v, now, cfg.gain_prior_s)
    ahead = bisect.bisect_left(_PLANNING["left"], r_v)
    return float(_PLANNING["sums"][ahead] / _PLANNING["gpus"])


Scheduler.plan = _backlog_plan  # type: ignore[method-assign]
gain.victim_rewait = _backlog_rewait
scheduler.victim_rewait = _backlog_rewait  # type: ignore[attr-defined]  # (the name it calls)


def backlog_rewait(durations: Mapping[str, float]) -> Scheduler:
    """``mlwe-rewait``, with a victim's re-wait projected from the backlog instead of
    learned: the queued work expected to be shorter than the victim's remaining
    time (GPU-seconds), over the cluster's GPUs."""
    sched = _variant(gain_rewait_quantile=0.9)
    sched._backlog_variant = True  # type: ignore[attr-defined]
    return sched


# ------------------------------------------------------------ resume quantum
# (SchedulerConfig.gain_quantum_share; the default, 0.25, was chosen over these)


def quantum_0(durations: Mapping[str, float]) -> Scheduler:
    """No quantum after an eviction but the core's minimum (the default before stop 53)."""
    return _variant(gain_quantum_share=0.0)


def quantum_0125(durations: Mapping[str, float]) -> Scheduler:
    """An equal evicted before is no victim among equals until its current run
    lasts an eighth of the service it resumed from (the default: a quarter)."""
    return _variant(gain_quantum_share=0.125)


def quantum_05(durations: Mapping[str, float]) -> Scheduler:
    """The same, half the service it resumed from."""
    return _variant(gain_quantum_share=0.5)


def quantum_1(durations: Mapping[str, float]) -> Scheduler:
    """The same, all the service it resumed from (its attained service doubles
    between evictions)."""
    return _variant(gain_quantum_share=1.0)
