"""The checkpoint model of a replay: what a preemption costs a trace job.

Real traces (Philly, ITP, Alibaba) say nothing about checkpoints, so a replay
must assume something, and the assumption decides how much a preemptive
policy pays. It is explicit, set on the command line (``--checkpoint``) and
printed in every report:

- ``periodic:INTERVAL[,cost=C][,restart=R]``: a job saves its state every
  INTERVAL seconds of work (each save pauses it C seconds), a preempted job
  loses the work since its last save, pays R seconds to restore when it
  resumes, and is released after the simulator's eviction delay. The default
  is ``periodic:1800,cost=0,restart=60`` (asynchronous saves every 30 min, a
  minute to restore): the cost of a save is 0 so that non-preemptive policies
  run every job exactly its trace duration, as the peers' simulators do.
- ``none``: jobs never checkpoint: a preemption throws away all the work of the
  attempt (the replays' behaviour before this model existed).
- ``free``: preemption is free and instant, as in the Tiresias authors'
  simulator: no work is lost, no eviction delay, no restore cost.

A job whose spec declares its own ``checkpoint_interval`` (the synthetic mix,
a generic CSV column) keeps it under ``periodic`` and ``none``; ``free``
overrides every job.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from mlwe.core.spec import WorkloadSpec

_PERIODIC = re.compile(r"^periodic:([^,]+)((?:,[a-z]+=[^,]+)*)$")


@dataclass(frozen=True, slots=True)
class CheckpointModel:
    kind: str = "periodic"  # "periodic", "none" or "free"
    interval_s: float = 1800.0
    cost_s: float = 0.0
    restart_s: float = 60.0

    @property
    def free(self) -> bool:
        return self.kind == "free"

    def text(self) -> str:
        """The canonical command-line form."""
        if self.kind != "periodic":
            return self.kind
        return f"periodic:{self.interval_s:g},cost={self.cost_s:g},restart={self.restart_s:g}"

    def describe(self) -> str:
        """One line for reports."""
        if self.kind == "free":
            return (
                "free: preemption is instant and loses nothing (no eviction delay, no"
                " restore cost; the Tiresias authors' simulator)"
            )
        if self.kind == "none":
            return (
                "none: trace jobs never checkpoint; a preemption loses all the work of the"
                " attempt, plus the eviction delay"
            )
        return (
            f"periodic: trace jobs without their own checkpoint interval save every"
            f" {self.interval_s:g} s of work (each save pauses {self.cost_s:g} s), restore"
            f" in {self.restart_s:g} s; a preemption loses the work since the last save,"
            " plus the eviction delay"
        )

    def apply(self, spec: WorkloadSpec) -> WorkloadSpec:
        """``spec`` as this model runs it."""
        if self.kind == "free":
            if spec.checkpoint_interval is None and not spec.restart_cost:
                return spec
            return spec.model_copy(
                update={"checkpoint_interval": None, "checkpoint_cost": 0.0, "restart_cost": 0.0}
            )
        if self.kind == "none" or spec.checkpoint_interval is not None:
            return spec
        return spec.model_copy(
            update={
                "checkpoint_interval": self.interval_s,
                "checkpoint_cost": self.cost_s,
                "restart_cost": max(spec.restart_cost, self.restart_s),
            }
        )


DEFAULT_CHECKPOINT = CheckpointModel()
FREE_PREEMPTION = CheckpointModel(kind="free", interval_s=0.0, cost_s=0.0, restart_s=0.0)
NO_CHECKPOINT = CheckpointModel(kind="none", interval_s=0.0, cost_s=0.0, restart_s=0.0)


def _seconds(text: str, what: str, *, positive: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        raise ValueError(f"checkpoint model: {what} {text!r} is not a number of seconds") from None
    if not math.isfinite(x) or x < 0 or (positive and x == 0):
        need = "positive" if positive else "zero or more"
        raise ValueError(f"checkpoint model: {what} {text!r} must be {need} and finite")
    return x


def parse_checkpoint_model(text: str) -> CheckpointModel:
    """``none``, ``free`` or ``periodic:INTERVAL[,cost=C][,restart=R]`` (seconds)."""
    form = text.strip().lower()
    if form == "free":
        return FREE_PREEMPTION
    if form == "none":
        return NO_CHECKPOINT
    m = _PERIODIC.match(form)
    if not m:
        raise ValueError(
            f"checkpoint model {text!r}: expected 'none', 'free' or"
            " 'periodic:INTERVAL[,cost=C][,restart=R]' (seconds), e.g. periodic:1800,restart=60"
        )
    interval = _seconds(m.group(1), "interval", positive=True)
    opts = {"cost": DEFAULT_CHECKPOINT.cost_s, "restart": DEFAULT_CHECKPOINT.restart_s}
    for part in filter(None, m.group(2).split(",")):
        key, _, value = part.partition("=")
        if key not in opts:
            raise ValueError(
                f"checkpoint model {text!r}: unknown option {key!r} (known: cost, restart)"
            )
        opts[key] = _seconds(value, key, positive=False)
    return CheckpointModel("periodic", interval, opts["cost"], opts["restart"])
