"""Event envelopes and the bus protocol both transports implement.

The bus is pull-style: a consumer ``fetch``-es a batch of :class:`Delivery`
objects from a durable consumer group and settles each one exactly once
(``ack``, ``retry`` after a delay, or ``dead_letter``). Delivery is
at-least-once; exactly-once *effects* come from the idempotent consumer
(:mod:`mlwe.bus.consumer`), never from the transport.

Subjects are dot-separated tokens (``workload.submitted``). Filters use the
NATS wildcards: ``*`` matches one token, ``>`` (last token only) one or more.
The ``dlq.`` namespace is reserved for dead letters: a dead-lettered envelope
travels on ``dlq.<its subject>``, so a filter may not start with a wildcard
(it would swallow the dead letters it produced).
"""

from __future__ import annotations

import json
import math
import random
import re
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

from mlwe.jsontext import loads_json

#: The reserved first token of dead-letter subjects.
DLQ_TOKEN = "dlq"
#: The durable consumer group a consumer joins when it names none.
DEFAULT_DURABLE = "mlwe"

_TOKEN = re.compile(r"^[A-Za-z0-9_\-]+$")
_DURABLE = re.compile(r"^[A-Za-z0-9_\-]{1,64}$")


class BusError(Exception):
    """Base class of every bus error."""


class BusClosed(BusError):
    """The bus was closed; nothing more can be published or fetched."""


class BusConnectionError(BusError):
    """The bus's server cannot be reached or lacks a required feature."""


class EnvelopeError(BusError, ValueError):
    """An envelope (or its wire form) is malformed; the message names the field."""


def validate_subject(subject: str) -> str:
    """A concrete subject: non-empty tokens of ``[A-Za-z0-9_-]`` joined by dots."""
    tokens = subject.split(".") if isinstance(subject, str) else []
    if not tokens or not all(_TOKEN.match(t) for t in tokens):
        raise EnvelopeError(
            f"subject {subject!r} is not a dot-separated list of tokens of [A-Za-z0-9_-]"
        )
    return subject


def validate_filter(subject_filter: str) -> str:
    """A subscription filter; wildcards allowed except as the first token."""
    tokens = subject_filter.split(".") if isinstance(subject_filter, str) else []
    for i, token in enumerate(tokens):
        if token == ">" and i == len(tokens) - 1:
            continue
        if token == "*" or _TOKEN.match(token):
            continue
        raise EnvelopeError(f"subject filter {subject_filter!r}: bad token {token!r}")
    if not tokens:
        raise EnvelopeError("subject filter is empty")
    if tokens[0] in ("*", ">"):
        raise EnvelopeError(
            f"subject filter {subject_filter!r} starts with a wildcard and would also match "
            f"the reserved dead-letter subjects '{DLQ_TOKEN}.>'; name the first token"
        )
    return subject_filter


def validate_durable(durable: str) -> str:
    if not isinstance(durable, str) or not _DURABLE.match(durable):
        raise EnvelopeError(f"durable consumer name {durable!r} must match [A-Za-z0-9_-]{{1,64}}")
    return durable


def subject_matches(subject_filter: str, subject: str) -> bool:
    """Whether ``subject`` matches ``subject_filter`` (NATS wildcard rules)."""
    want = subject_filter.split(".")
    have = subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(have) == len(want)


def dlq_subject(subject: str) -> str:
    """The subject a dead-lettered envelope of ``subject`` travels on."""
    return f"{DLQ_TOKEN}.{subject}"


@dataclass(frozen=True)
class Envelope:
    """One event: what happened (subject, payload) and the ids that trace it.

    ``id`` is the idempotency key: every copy of the same event carries the
    same id. ``correlation_id`` ties the event to the request that caused it.
    ``attempt`` is delivery metadata (1 on first delivery), set by the bus;
    it is not part of the wire form, so every copy of an event has the same
    bytes.
    """

    id: str
    subject: str
    payload: dict[str, Any]
    correlation_id: str
    published_at: float
    attempt: int = 1

    def __hash__(self) -> int:
        # The payload is a dict (unhashable); equal envelopes share id and attempt.
        return hash((self.id, self.attempt))

    def to_bytes(self) -> bytes:
        """Canonical JSON (sorted keys, no whitespace, UTF-8), without ``attempt``."""
        doc = {
            "id": self.id,
            "subject": self.subject,
            "payload": self.payload,
            "correlation_id": self.correlation_id,
            "published_at": self.published_at,
        }
        try:
            text = json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=False,
                              allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise EnvelopeError(f"envelope {self.id}: payload is not canonical JSON: {exc}") from exc
        return text.encode("utf-8")

    @classmethod
    def from_bytes(cls, data: bytes | str, *, attempt: int = 1) -> Envelope:
        """Parse the wire form; a malformed document raises :class:`EnvelopeError`."""
        try:
            doc = loads_json(data)
        except (ValueError, UnicodeDecodeError) as exc:
            raise EnvelopeError(f"envelope is not JSON: {exc}") from exc
        if not isinstance(doc, dict):
            raise EnvelopeError("envelope is not a JSON object")
        for name in ("id", "subject", "correlation_id"):
            if not isinstance(doc.get(name), str) or not doc[name]:
                raise EnvelopeError(f"envelope field {name!r} must be a non-empty string")
        if not isinstance(doc.get("payload"), dict):
            raise EnvelopeError("envelope field 'payload' must be an object")
        published_at = doc.get("published_at")
        if isinstance(published_at, bool) or not isinstance(published_at, int | float):
            raise EnvelopeError("envelope field 'published_at' must be a number")
        validate_subject(doc["subject"])
        return cls(
            id=doc["id"],
            subject=doc["subject"],
            payload=doc["payload"],
            correlation_id=doc["correlation_id"],
            published_at=float(published_at),
            attempt=attempt,
        )

    def with_attempt(self, attempt: int) -> Envelope:
        return replace(self, attempt=attempt)


def new_envelope(
    subject: str,
    payload: dict[str, Any],
    correlation_id: str | None = None,
    *,
    clock: Callable[[], float] = time.time,
) -> Envelope:
    """A fresh event with a new id; the correlation id defaults to that id."""
    validate_subject(subject)
    if subject.split(".")[0] == DLQ_TOKEN:
        raise EnvelopeError(f"subject {subject!r}: '{DLQ_TOKEN}.' is reserved for dead letters")
    event_id = uuid.uuid4().hex
    env = Envelope(
        id=event_id,
        subject=subject,
        payload=payload,
        correlation_id=correlation_id or event_id,
        published_at=clock(),
    )
    env.to_bytes()  # fail here, at the edge, if the payload is not JSON
    return env


@dataclass(frozen=True)
class Backoff:
    """Exponential backoff with jitter: ``base * factor**(attempt-1)``, capped.

    The jitter takes a random fraction (up to ``jitter``) off the delay, so
    retries of events that failed together spread out instead of stampeding.
    """

    base: float = 0.05
    factor: float = 2.0
    cap: float = 5.0
    jitter: float = 0.5

    def __post_init__(self) -> None:
        if not (self.base > 0 and self.factor >= 1 and self.cap >= self.base):
            raise ValueError("backoff needs base > 0, factor >= 1, cap >= base")
        if not 0 <= self.jitter <= 1:
            raise ValueError("backoff jitter is a fraction in [0, 1]")

    def delay(self, attempt: int, rng: random.Random) -> float:
        """Seconds to wait before delivery ``attempt + 1`` after ``attempt`` failed."""
        exponent = max(0, attempt - 1)
        # Cap before exponentiating far: factor**exponent overflows for huge attempts.
        if exponent > 64 or self.base * self.factor**exponent >= self.cap:
            raw = self.cap
        else:
            raw = self.base * self.factor**exponent
        out = raw * (1.0 - self.jitter * rng.random())
        return out if math.isfinite(out) else self.cap


class Delivery(Protocol):
    """One delivered copy of an envelope; settle it exactly once."""

    @property
    def envelope(self) -> Envelope: ...

    async def ack(self) -> None:
        """Done: never deliver this copy again."""

    async def retry(self, delay: float) -> None:
        """Failed: deliver this copy again after ``delay`` seconds (attempt + 1)."""

    async def dead_letter(self, error: str) -> None:
        """Give up: publish the envelope on ``dlq.<subject>`` and acknowledge this copy."""


class Bus(Protocol):
    """At-least-once event transport with durable, pull-style consumer groups.

    An unsettled delivery (the consumer crashed, or took longer than the
    bus's ack wait) is delivered again. ``durable`` names a consumer group:
    its members share the work, and the group keeps its position across
    restarts (for transports that persist).
    """

    async def publish(self, envelope: Envelope) -> None:
        """Durably accept ``envelope`` (it is stored once this returns)."""

    async def publish_many(self, envelopes: Sequence[Envelope]) -> None:
        """Publish several envelopes, pipelined where the transport allows."""

    async def fetch(
        self,
        subject_filter: str,
        *,
        durable: str = DEFAULT_DURABLE,
        batch: int = 100,
        timeout: float = 1.0,
    ) -> list[Delivery]:
        """Up to ``batch`` deliveries; waits up to ``timeout`` s for the first, else []."""
        ...

    async def pending(self, subject_filter: str, *, durable: str = DEFAULT_DURABLE) -> int:
        """Copies not yet settled for this group: queued, in flight or awaiting retry."""
        ...

    async def close(self) -> None:
        """Release connections; idempotent."""


@dataclass
class BusStats:
    """Transport-level counters (the consumer keeps the semantic ones)."""

    published: int = 0
    delivered: int = 0
    redelivered: int = 0
    dead_lettered: int = 0
