"""Bus ingress: requests arriving as events (in-process bus or NATS JetStream) into the engine.

A request is an envelope on ``mlwe.requests.<type>`` whose payload says what
to do::

    {"type": "submit", "workloads": [<workload spec>, ...], "actor": "ci-bot"}
    {"type": "cancel", "workload": "ft-7"}
    {"type": "node-status", "node": "gpu-3", "status": "cordoned", "reason": "flaky"}
    {"type": "set-priority", "workload": "emb-2", "priority": 100}

:class:`EngineIngress` is the bus's idempotent consumer with the engine as the
effect: the event id is recorded as processed in the same transaction as the
state change (see :meth:`mlwe.runtime.engine.Engine.ingest`), so redelivered
and duplicated events have no second effect. A malformed or refused request
is retried like any failure and then dead-lettered with the reasons, where an
operator can read it (``mlwe events dead-letters``) and replay it.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from sqlalchemy import Connection

from mlwe.bus.base import Bus, Envelope, EnvelopeError
from mlwe.bus.consumer import IdempotentConsumer
from mlwe.core.actions import Action, Cancel, SetNodeStatus, SetPriority, Submit
from mlwe.core.spec import NodeStatus, WorkloadSpec
from mlwe.runtime.engine import Engine

SUBJECT_FILTER = "mlwe.requests.>"


class _Base(BaseModel):
    model_config = ConfigDict(extra="forbid")
    actor: str = Field(default="bus", max_length=128)


class SubmitRequest(_Base):
    type: Literal["submit"]
    workloads: list[dict[str, Any]] = Field(min_length=1, max_length=10_000)


class CancelRequest(_Base):
    type: Literal["cancel"]
    workload: str = Field(min_length=1, max_length=128)


class NodeStatusRequest(_Base):
    type: Literal["node-status"]
    node: str = Field(min_length=1, max_length=128)
    status: NodeStatus
    reason: str = Field(default="", max_length=500)


class SetPriorityRequest(_Base):
    type: Literal["set-priority"]
    workload: str = Field(min_length=1, max_length=128)
    priority: int


Request = Annotated[
    SubmitRequest | CancelRequest | NodeStatusRequest | SetPriorityRequest,
    Field(discriminator="type"),
]
_REQUEST: TypeAdapter[Any] = TypeAdapter(Request)  # type: ignore[arg-type,unused-ignore]


def decode_request(payload: dict[str, Any], catalog: Any = None) -> tuple[list[Action], str]:
    """The control-plane actions a request payload asks for, and its actor.

    Raises :class:`EnvelopeError` naming the field when the payload is malformed.
    """
    try:
        req = _REQUEST.validate_python(payload)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise EnvelopeError(f"bad request: {where}: {first['msg']}") from None
    if isinstance(req, SubmitRequest):
        specs = []
        ctx = {"catalog": catalog} if catalog is not None else None
        for i, doc in enumerate(req.workloads):
            try:
                specs.append(WorkloadSpec.model_validate(doc, context=ctx))
            except ValidationError as exc:
                first = exc.errors()[0]
                where = ".".join(str(p) for p in first["loc"])
                raise EnvelopeError(f"bad request: workloads[{i}].{where}: {first['msg']}") from None
        return [Submit(s) for s in specs], req.actor
    if isinstance(req, CancelRequest):
        return [Cancel(req.workload)], req.actor
    if isinstance(req, NodeStatusRequest):
        return [SetNodeStatus(req.node, req.status, req.reason or f"set by {req.actor}")], req.actor
    return [SetPriority(req.workload, req.priority, f"set by {req.actor}")], req.actor


class EngineIngress(IdempotentConsumer):
    """The idempotent consumer whose effect is an engine request (module docstring)."""

    def __init__(self, engine: Engine, **kwargs: Any) -> None:
        self.eng = engine
        super().__init__(engine.repo.engine, self._no_handler, clock=engine.clock.now, **kwargs)

    @staticmethod
    def _no_handler(envelope: Envelope, conn: Connection) -> None:  # pragma: no cover
        raise AssertionError("EngineIngress applies through the engine")

    def _apply_on(self, conn: Connection, envelope: Envelope) -> bool:
        actions, actor = decode_request(envelope.payload, self.eng.reads.catalog)
        return self.eng.ingest(
            envelope.id,
            actions,
            actor=actor,
            correlation_id=envelope.correlation_id,
            what={"action": envelope.payload.get("type"), "subject": envelope.subject},
        )


class IngressRunner:
    """Consume requests from a bus on a background thread (its own event loop) into an engine.

    ``bus_factory`` is an async callable returning a connected :class:`~mlwe.bus.base.Bus`
    (e.g. ``lambda: NatsBus.connect(url)``); :meth:`stop` ends the consumer and closes it.
    """

    def __init__(
        self,
        engine: Engine,
        bus_factory: Callable[[], Awaitable[Bus]],
        *,
        durable: str = "mlwe-engine",
        subject_filter: str = SUBJECT_FILTER,
    ) -> None:
        self.engine = engine
        self.bus_factory = bus_factory
        self.durable = durable
        self.subject_filter = subject_filter
        self.ingress = EngineIngress(engine)
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    def start(self, timeout_s: float = 15.0) -> IngressRunner:
        self._thread = threading.Thread(target=self._run, name="mlwe-ingress", daemon=True)
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError("the bus ingress did not start in time")
        if self.error is not None:
            raise self.error
        return self

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:  # reported by start() or kept for health
            self.error = exc
            self._ready.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        bus = await self.bus_factory()
        self._ready.set()
        try:
            await self.ingress.run(bus, self.subject_filter, durable=self.durable, stop=self._stop)
        finally:
            await bus.close()

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None:
            with contextlib.suppress(RuntimeError):  # the loop already ended
                self._loop.call_soon_threadsafe(self._stop.set)
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


def nats_ingress(engine: Engine, url: str, *, prefix: str = "mlwe") -> IngressRunner:
    """Start consuming ``mlwe.requests.*`` from NATS JetStream at ``url`` into ``engine``."""
    from mlwe.bus.nats import NatsBus

    async def connect() -> Bus:
        return await NatsBus.connect(url, prefix=prefix)

    return IngressRunner(engine, connect).start()
