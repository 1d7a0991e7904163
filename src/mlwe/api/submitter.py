"""Group commit across HTTP requests: many concurrent submissions, few disk syncs.

Each submission must be durable before it is acknowledged. One fsync per
request would cap the API at a few hundred submissions per second, so
concurrent requests are queued and handed to the engine in batches
(``Engine.submit_many``, the engine's one request path): every request in a
batch is still its own all-or-nothing ``apply`` with its own actor,
correlation id and audit record (nothing is merged), but the batch is made
durable by one commit, and if the store cannot take it, none of it is kept.
A batch forms by itself while the previous one is being written, so a lone
request waits for nobody.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

from mlwe.core.controlplane import ApplyResult
from mlwe.core.spec import WorkloadSpec
from mlwe.runtime.engine import Engine
from mlwe.runtime.requests import Request, submit_request

log = logging.getLogger("mlwe.api.submitter")

OnDurable = Callable[[Any, ApplyResult], None]


class SubmitQueue:
    """Hands concurrent submissions to the engine in batches, from one worker thread."""

    def __init__(self, engine: Engine, *, max_batch: int = 256) -> None:
        self.engine = engine
        self.max_batch = max_batch
        self._items: list[tuple[Request, Future[ApplyResult]]] = []
        self._cond = threading.Condition()
        self._closed = False
        self.batches = 0
        self.requests = 0
        self._thread = threading.Thread(target=self._run, name="mlwe-submit-queue", daemon=True)
        self._thread.start()

    async def submit(
        self,
        specs: Sequence[WorkloadSpec],
        actor: str,
        correlation_id: str,
        on_durable: OnDurable | None = None,
    ) -> ApplyResult:
        """Submit through the engine's request path; ``on_durable`` runs in the transaction
        that stores the workloads (raises ``StoreRefused`` when nothing could be kept)."""
        fut: Future[ApplyResult] = Future()
        with self._cond:
            if self._closed:
                raise RuntimeError("the server is shutting down")
            self._items.append((submit_request(specs, actor, correlation_id, on_durable), fut))
            self._cond.notify()
        return await asyncio.wrap_future(fut)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._items and not self._closed:
                    self._cond.wait()
                if not self._items and self._closed:
                    return
                batch = self._items[: self.max_batch]
                del self._items[: self.max_batch]
            try:
                results = self.engine.requests([req for req, _ in batch])
            except BaseException as exc:  # the store failed: every request in the batch hears it
                log.warning("submission batch failed: %s", exc)
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            self.batches += 1
            self.requests += len(batch)
            for (_, fut), res in zip(batch, results):
                fut.set_result(res)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
