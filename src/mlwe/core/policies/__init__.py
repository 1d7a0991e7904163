"""Scheduling policies as small plug-ins, registered here explicitly (no import side effects)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from types import MappingProxyType

from mlwe.core.policies.ordering import ArrivalOrder, OrderingPolicy, PriorityDeadlineFairShare
from mlwe.core.policies.placement import BestFit, PlacementPolicy, Spread
from mlwe.core.policies.preemption import (
    CheapestVictims,
    LowestPriorityVictims,
    PreemptionPolicy,
)

ORDERING_POLICIES: Mapping[str, Callable[[], OrderingPolicy]] = MappingProxyType(
    {
        PriorityDeadlineFairShare.name: PriorityDeadlineFairShare,
        ArrivalOrder.name: ArrivalOrder,
    }
)
PLACEMENT_POLICIES: Mapping[str, Callable[[], PlacementPolicy]] = MappingProxyType(
    {BestFit.name: BestFit, Spread.name: Spread}
)
PREEMPTION_POLICIES: Mapping[str, Callable[[], PreemptionPolicy]] = MappingProxyType(
    {CheapestVictims.name: CheapestVictims, LowestPriorityVictims.name: LowestPriorityVictims}
)

__all__ = ["ORDERING_POLICIES", "PLACEMENT_POLICIES", "PREEMPTION_POLICIES"]
