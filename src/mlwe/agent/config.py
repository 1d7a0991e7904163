"""How an agent (:class:`mlwe.agent.loop.Agent`) is set up: its :class:`AgentConfig`, and
the shapes of the sinks it proposes through and records into."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from mlwe.agent.model import Mode
from mlwe.agent.triggers import AnalyzeConfig
from mlwe.agent.whatif import WhatIfConfig
from mlwe.core.actions import Action
from mlwe.core.controlplane import ApplyResult

#: (actions, expected_version, correlation_id, rationale) -> the control plane's answer
ProposeFn = Callable[[Sequence[Action], int | None, str, str], ApplyResult]
Sink = Callable[[dict[str, Any]], None]


@dataclass
class AgentConfig:
    mode: Mode = Mode.AUTONOMOUS
    #: without lifecycle news, at most one analysis per this many seconds (engine clock)
    min_interval_s: float = 30.0
    #: with news too, at most one analysis per this many seconds of engine time: the
    #: analysis (triggers, plans, forecasts) is the heavy part, not run every engine tick
    analysis_interval_s: float = 5.0
    #: after a decision about a finding, leave it alone this long (unless it changes)
    cooldown_s: float = 1800.0
    max_attempts: int = 3  # plans tried per finding per round (feedback loop)
    max_findings_per_tick: int = 8
    whatif: bool = True  # forecast before commit (off: verified plans commit as chosen)
    node_failure_after_s: float = 1800.0  # assumed time to failure of an unhealthy node
    stream_lookback_s: float = 3 * 3600.0  # recurring arrivals: the window looked at
    stream_min: int = 3  # arrivals of one (queue, priority) in the window to call it a stream
    stream_max: int = 500  # expected arrivals played in one forecast, at most
    analyze: AnalyzeConfig = field(default_factory=AnalyzeConfig)
    forecast: WhatIfConfig = field(default_factory=WhatIfConfig)
