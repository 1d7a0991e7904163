"""Group commit: concurrent callers' requests made durable by one flush.

Each caller files its requests as a ticket and takes the commit mutex; whoever
gets it first (the leader) takes every ticket filed so far and makes them
durable together, so N concurrent submissions cost one transaction and one
disk sync instead of N. A caller whose ticket a leader already served returns
at once with its results. If the store refuses the batch, every ticket in it
gets the same :class:`~mlwe.runtime.requests.StoreRefused` (nothing was kept).

The batch function (the engine's ``_durably``) decides what durable means;
this module only groups and hands back results in the callers' order.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from mlwe.core.controlplane import ApplyResult
from mlwe.runtime.requests import Request, StoreRefused

Durably = Callable[[Sequence[Request]], list[ApplyResult]]


@dataclass
class _Ticket:
    """One caller's requests waiting for the group commit that covers them."""

    requests: list[Request]
    results: list[ApplyResult] = field(default_factory=list)
    error: StoreRefused | None = None
    done: bool = False


class GroupCommit:
    """Tickets and the mutex that whoever commits a group holds (module docstring)."""

    def __init__(self, durably: Durably) -> None:
        self._durably = durably
        self._pending: list[_Ticket] = []
        self._pending_lock = threading.Lock()
        #: held by the caller committing a group (and by anything that must not
        #: interleave with one, e.g. an exactly-once bus ingest)
        self.mutex = threading.Lock()

    def run(self, reqs: Sequence[Request]) -> list[ApplyResult]:
        """The results of ``reqs``, once durable (in a group with whoever else waits);
        raises :class:`StoreRefused` if the store could not take the group."""
        ticket = _Ticket(list(reqs))
        with self._pending_lock:
            self._pending.append(ticket)
        with self.mutex:
            if not ticket.done:
                with self._pending_lock:
                    batch, self._pending = self._pending, []
                self._commit(batch)
        if ticket.error is not None:
            raise ticket.error
        return ticket.results

    def _commit(self, tickets: list[_Ticket]) -> None:
        reqs = [r for t in tickets for r in t.requests]
        try:
            results = self._durably(reqs)
        except StoreRefused as exc:
            for t in tickets:
                t.error, t.done = exc, True
            return
        k = 0
        for t in tickets:
            t.results, t.done = results[k : k + len(t.requests)], True
            k += len(t.requests)
