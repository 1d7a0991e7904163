"""The NATS JetStream bus, for deployments of more than one process.

One stream holds every subject under ``<prefix>.>``; an envelope of subject
``s`` is stored on ``<prefix>.s`` and, once dead-lettered, on
``<prefix>.dlq.s`` (same stream, so the dead letters are durable too, with
``Mlwe-Error`` and ``Mlwe-Attempts`` headers). Consumer groups are durable
pull consumers with explicit acks; a retry is a NAK with a delay, and the
attempt number is JetStream's delivery count. The consumer decides when to
give up (its ``max_attempts``), so ``max_deliver`` defaults to unlimited: a
finite one is a backstop for a poison message that kills its process before
it can be dead-lettered, but a message past it is never delivered again,
which would lose events during a long database outage.

JetStream's publish-side deduplication (``Nats-Msg-Id``) is deliberately not
used: the consumer's processed-ids table is the single place that decides,
and a replayed dead letter keeps its event id, which a dedup window would
silently drop.

Requires the optional ``nats-py`` dependency (``pip install mlwe[nats]``).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from typing import Any

from mlwe.core.extras import missing_extra

try:  # nats-py is the mlwe[nats] extra
    import nats
    import nats.errors
    import nats.js.errors
    from nats.aio.client import Client
    from nats.aio.msg import Msg
    from nats.js import JetStreamContext
    from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, StorageType
except ImportError as exc:
    raise missing_extra("nats", exc) from exc

from mlwe.bus.base import (
    DEFAULT_DURABLE,
    DLQ_TOKEN,
    BusClosed,
    BusConnectionError,
    BusError,
    BusStats,
    Delivery,
    Envelope,
    EnvelopeError,
    dlq_subject,
    validate_durable,
    validate_filter,
    validate_subject,
)

log = logging.getLogger(__name__)

DEFAULT_URL = "nats://127.0.0.1:4222"
_PREFIX = re.compile(r"^[A-Za-z0-9_\-]+(\.[A-Za-z0-9_\-]+)*$")
_HEADER_MAX = 1024


def _header_value(text: str) -> str:
    """A header-safe one-line rendering (no CR/LF: they would split the header block)."""
    flat = " ".join(text.split())
    return flat[:_HEADER_MAX]


class NatsDelivery:
    """One JetStream message, parsed; settled through its reply subject."""

    __slots__ = ("_bus", "_envelope", "_msg", "_settled")

    def __init__(self, bus: NatsBus, msg: Msg, envelope: Envelope) -> None:
        self._bus = bus
        self._msg = msg
        self._envelope = envelope
        self._settled = False

    @property
    def envelope(self) -> Envelope:
        return self._envelope

    @property
    def headers(self) -> dict[str, str]:
        """The message headers (a dead letter carries ``Mlwe-Error`` and ``Mlwe-Attempts``)."""
        return dict(self._msg.headers or {})

    def _settle(self) -> None:
        if self._settled:
            raise BusError(f"delivery of {self._envelope.id} was already settled")
        self._settled = True

    async def ack(self) -> None:
        self._settle()
        await self._msg.ack()

    async def retry(self, delay: float) -> None:
        self._settle()
        # nak(delay=0) would mean "now"; a tiny positive delay keeps the intent explicit.
        await self._msg.nak(delay=max(delay, 0.001))

    async def dead_letter(self, error: str) -> None:
        self._settle()
        env = self._envelope
        await self._bus._js.publish(
            self._bus.transport_subject(dlq_subject(env.subject)),
            env.to_bytes(),
            stream=self._bus.stream,
            headers={"Mlwe-Error": _header_value(error) or "error",
                     "Mlwe-Attempts": str(env.attempt)},
        )
        self._bus.stats.dead_lettered += 1
        await self._msg.ack()


class NatsBus:
    """JetStream transport (see the module docstring). Create with :meth:`connect`."""

    def __init__(
        self,
        nc: Client,
        *,
        url: str,
        prefix: str,
        stream: str,
        ack_wait: float,
        max_deliver: int,
        max_ack_pending: int,
    ) -> None:
        self._nc = nc
        self._js: JetStreamContext = nc.jetstream()
        self.url = url
        self.prefix = prefix
        self.stream = stream
        self.ack_wait = ack_wait
        self.max_deliver = max_deliver
        self.max_ack_pending = max_ack_pending
        self.stats = BusStats()
        self._subs: dict[str, tuple[str, JetStreamContext.PullSubscription]] = {}
        self._closed = False

    @classmethod
    async def connect(
        cls,
        url: str = DEFAULT_URL,
        *,
        prefix: str = "mlwe",
        stream: str | None = None,
        connect_timeout: float = 5.0,
        ack_wait: float = 30.0,
        max_deliver: int = -1,
        max_ack_pending: int = 10_000,
        storage: str = "file",
        **options: Any,
    ) -> NatsBus:
        """Connect, check JetStream, and create the stream if it does not exist.

        Extra ``options`` go to ``nats.connect`` (credentials, TLS, reconnect
        policy). Any failure raises :class:`BusConnectionError` naming ``url``.
        """
        if not _PREFIX.match(prefix) or prefix.split(".")[0] == DLQ_TOKEN:
            raise ValueError(f"prefix {prefix!r} must be dot-separated tokens of [A-Za-z0-9_-]")
        if max_deliver != -1 and max_deliver < 2:
            raise ValueError("max_deliver must be -1 (unlimited) or at least 2")
        stream_name = stream or re.sub(r"[^A-Za-z0-9_\-]", "_", prefix).upper()
        storage_type = {"file": StorageType.FILE, "memory": StorageType.MEMORY}.get(storage)
        if storage_type is None:
            raise ValueError("storage is 'file' or 'memory'")

        last_error: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            last_error.append(exc)
            log.debug("NATS %s: %r", url, exc)

        nc = Client()
        options.setdefault("error_cb", on_error)
        try:
            # nats-py keeps retrying an unreachable server for minutes by default;
            # bound the first connection so a wrong URL fails fast and clearly.
            await asyncio.wait_for(
                nc.connect(servers=[url], connect_timeout=max(1, int(connect_timeout)), **options),
                timeout=connect_timeout,
            )
        except (TimeoutError, OSError, nats.errors.Error) as exc:
            await _quiet_close(nc)
            cause = last_error[-1] if last_error else exc
            raise BusConnectionError(
                f"cannot connect to NATS at {url}: {cause!r} "
                "(is nats-server running there, with JetStream enabled: nats-server -js?)"
            ) from exc

        js = nc.jetstream()
        try:
            try:
                await js.stream_info(stream_name)
            except nats.js.errors.NotFoundError:
                await js.add_stream(
                    name=stream_name, subjects=[f"{prefix}.>"], storage=storage_type
                )
        except (nats.errors.NoRespondersError, nats.js.errors.ServiceUnavailableError,
                nats.errors.TimeoutError) as exc:
            await _quiet_close(nc)
            raise BusConnectionError(
                f"NATS at {url} does not answer JetStream requests ({exc!r}); "
                "start nats-server with JetStream enabled (-js)"
            ) from exc
        except nats.js.errors.APIError as exc:
            await _quiet_close(nc)
            raise BusConnectionError(
                f"NATS at {url}: cannot create stream {stream_name!r} over '{prefix}.>': {exc}"
            ) from exc
        return cls(
            nc,
            url=url,
            prefix=prefix,
            stream=stream_name,
            ack_wait=ack_wait,
            max_deliver=max_deliver,
            max_ack_pending=max_ack_pending,
        )

    def transport_subject(self, subject: str) -> str:
        return f"{self.prefix}.{subject}"

    # -- publishing ---------------------------------------------------------

    def _check_publishable(self, envelope: Envelope) -> bytes:
        self._check_open()
        validate_subject(envelope.subject)
        if envelope.subject.split(".")[0] == DLQ_TOKEN:
            raise EnvelopeError(
                f"subject {envelope.subject!r}: '{DLQ_TOKEN}.' is reserved for dead letters"
            )
        return envelope.to_bytes()

    async def publish(self, envelope: Envelope) -> None:
        data = self._check_publishable(envelope)
        await self._js.publish(
            self.transport_subject(envelope.subject), data, stream=self.stream
        )
        self.stats.published += 1

    async def publish_many(self, envelopes: Sequence[Envelope], *, window: int = 1000) -> None:
        """Pipelined publish: up to ``window`` un-acknowledged publishes at a time."""
        for start in range(0, len(envelopes), window):
            chunk = envelopes[start : start + window]
            futures = []
            for envelope in chunk:
                data = self._check_publishable(envelope)
                futures.append(
                    await self._js.publish_async(
                        self.transport_subject(envelope.subject), data, stream=self.stream
                    )
                )
            await asyncio.gather(*futures)
            self.stats.published += len(chunk)

    # -- consuming ----------------------------------------------------------

    async def _subscription(
        self, subject_filter: str, durable: str
    ) -> JetStreamContext.PullSubscription:
        self._check_open()
        known = self._subs.get(durable)
        if known is not None:
            if known[0] != subject_filter:
                raise EnvelopeError(
                    f"durable consumer {durable!r} consumes {known[0]!r}, not {subject_filter!r}"
                )
            return known[1]
        validate_filter(subject_filter)
        validate_durable(durable)
        wanted = self.transport_subject(subject_filter)
        config = ConsumerConfig(
            durable_name=durable,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=self.ack_wait,
            max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending,
        )
        sub = await self._js.pull_subscribe(wanted, durable=durable, stream=self.stream,
                                            config=config)
        info = await sub.consumer_info()
        # pull_subscribe binds to an existing durable without checking its filter.
        if info.config.filter_subject not in (None, wanted):
            await sub.unsubscribe()
            raise EnvelopeError(
                f"durable consumer {durable!r} on stream {self.stream} already filters "
                f"{info.config.filter_subject!r}, not {wanted!r}; use another durable name"
            )
        self._subs[durable] = (subject_filter, sub)
        return sub

    async def fetch(
        self,
        subject_filter: str,
        *,
        durable: str = DEFAULT_DURABLE,
        batch: int = 100,
        timeout: float = 1.0,
    ) -> list[Delivery]:
        sub = await self._subscription(subject_filter, durable)
        try:
            msgs = await sub.fetch(batch=batch, timeout=max(timeout, 0.01))
        except TimeoutError:  # nats-py raises both its own and asyncio's: nothing arrived
            return []
        out: list[Delivery] = []
        for msg in msgs:
            attempt = msg.metadata.num_delivered or 1
            try:
                envelope = Envelope.from_bytes(msg.data, attempt=attempt)
            except EnvelopeError as exc:
                # Bytes that are not an envelope can never be handled: drop them loudly.
                log.error("NATS %s: terminating unparseable message on %s: %s",
                          self.url, msg.subject, exc)
                await msg.term()
                continue
            self.stats.delivered += 1
            if attempt > 1:
                self.stats.redelivered += 1
            out.append(NatsDelivery(self, msg, envelope))
        return out

    async def pending(self, subject_filter: str, *, durable: str = DEFAULT_DURABLE) -> int:
        sub = await self._subscription(subject_filter, durable)
        info = await sub.consumer_info()
        return int(info.num_pending or 0) + int(info.num_ack_pending or 0)

    # -- lifecycle ----------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise BusClosed(f"the NATS bus for {self.url} is closed")

    async def delete_stream(self) -> None:
        """Delete this bus's stream and everything in it (tests, teardown)."""
        await self._js.delete_stream(self.stream)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._subs.clear()
        try:
            await self._nc.flush(timeout=5)  # acks are fire-and-forget publishes
        except (nats.errors.Error, TimeoutError):
            log.warning("NATS %s: could not flush pending acks before closing", self.url)
        await _quiet_close(self._nc)


async def _quiet_close(nc: Client) -> None:
    try:
        await nc.close()
    except Exception:  # closing a half-open client must not mask the real error
        log.debug("NATS close failed", exc_info=True)


__all__ = ["DEFAULT_URL", "NatsBus", "NatsDelivery"]
