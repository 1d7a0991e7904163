"""The runtime: one engine wired from core + backend + store + bus (+ agent, API).

See :mod:`mlwe.runtime.engine` for the loop and its guarantees.
"""

from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine, EngineConfig, TickReport
from mlwe.runtime.restart import RestartReport
from mlwe.runtime.streams import TOPICS, StreamEvent, StreamHub, Subscription
from mlwe.sim.live import LiveSimBackend

__all__ = [
    "TOPICS",
    "Engine",
    "EngineConfig",
    "LiveSimBackend",
    "RestartReport",
    "StreamEvent",
    "StreamHub",
    "Subscription",
    "TickReport",
    "WallClock",
]
