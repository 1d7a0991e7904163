"""Event ingress: envelopes, the bus protocol, its transports, the idempotent consumer.

The in-process bus is the default and needs no service; the NATS JetStream
adapter (``mlwe.bus.nats.NatsBus``, optional ``nats-py`` dependency) is for
multi-process deployments and is imported only when asked for.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from mlwe.bus.base import (
    DEFAULT_DURABLE,
    Backoff,
    Bus,
    BusClosed,
    BusConnectionError,
    BusError,
    BusStats,
    Delivery,
    Envelope,
    EnvelopeError,
    new_envelope,
    subject_matches,
)
from mlwe.bus.consumer import (
    ConsumerMetrics,
    DeadLetter,
    Handler,
    IdempotentConsumer,
    Outcome,
    dead_letters,
    replay_dead_letter,
)
from mlwe.bus.inprocess import InProcessBus

if TYPE_CHECKING:
    from mlwe.bus.nats import NatsBus

__all__ = [
    "DEFAULT_DURABLE",
    "Backoff",
    "Bus",
    "BusClosed",
    "BusConnectionError",
    "BusError",
    "BusStats",
    "ConsumerMetrics",
    "DeadLetter",
    "Delivery",
    "Envelope",
    "EnvelopeError",
    "Handler",
    "IdempotentConsumer",
    "InProcessBus",
    "NatsBus",
    "Outcome",
    "dead_letters",
    "new_envelope",
    "replay_dead_letter",
    "subject_matches",
]


def __getattr__(name: str) -> Any:
    # NatsBus needs the optional nats-py package: import it on first use only.
    if name == "NatsBus":
        from mlwe.bus.nats import NatsBus

        return NatsBus
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
