"""What applied batches did, as values, and the log that keeps them for their readers.

An :class:`Effects` is one applied batch's record: its lifecycle transitions,
the workloads, nodes and queues it changed, and the decision records filed
with it. A decision record filed outside a batch (a rejection, a changed
pending reason) is an :class:`Effects` of its own that holds only it.

The :class:`EffectsLog` keeps them in the order they were made for named
readers (the reconciler: what is owed to the backend; the store writer: what
to write), each with its own cursor: a reader sees every record made after it
started following, and reading does not take from the others. A record is
dropped once every reader has read past it, so a log nobody follows keeps
nothing. The control plane's ``rollback_to`` drops the records of the batches
it undoes, for every reader.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from mlwe.core.actions import (
    Action,
    AddNode,
    Preempt,
    SetNodeStatus,
    SetQueue,
    SetResources,
    Submit,
)
from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import Transition
from mlwe.core.model import Workload
from mlwe.core.spec import NodeSpec


class Changed(NamedTuple):
    """One lifecycle transition an applied batch made, with what the workload's
    retry bookkeeping said when the batch was applied (a later batch may change it
    before the transition is read)."""

    workload: Workload
    transition: Transition
    attempt: int
    failures: int
    failure_cause: str | None


@dataclass(frozen=True, slots=True)
class Effects:
    """What one applied batch did; or, with only ``decisions``, decision records
    filed outside a batch. Ids are in the order the batch first named them."""

    #: The version the batch made (records filed outside a batch: the version then).
    version: int
    #: Its lifecycle transitions, in the order it made them.
    transitions: tuple[Changed, ...] = ()
    #: Workloads whose record changed: those it transitioned, created, or named
    #: (a progress report or a priority change has no transition).
    workloads: tuple[str, ...] = ()
    nodes_added: tuple[NodeSpec, ...] = ()
    node_status: tuple[str, ...] = ()  # nodes whose status it set
    queues: tuple[str, ...] = ()  # queues it set
    respecified: tuple[str, ...] = ()  # workloads whose spec it changed (SetResources)
    #: The decision records filed with it, stamped, in order.
    decisions: tuple[DecisionRecord, ...] = ()


def batch_effects(
    version: int,
    actions: Sequence[Action],
    transitions: tuple[Changed, ...],
    created: Sequence[str],
    decisions: tuple[DecisionRecord, ...],
) -> Effects:
    """The :class:`Effects` of a batch of ``actions`` that was applied."""
    nodes_added: list[NodeSpec] = []
    node_status: dict[str, None] = {}
    queues: dict[str, None] = {}
    respecified: dict[str, None] = {}
    for a in actions:
        if isinstance(a, AddNode):
            nodes_added.append(a.spec)
        elif isinstance(a, SetNodeStatus):
            node_status[a.node] = None
        elif isinstance(a, SetQueue):
            queues[a.spec.name] = None
        elif isinstance(a, SetResources):
            respecified[a.workload] = None
    return Effects(version, transitions, changed_workloads(actions, transitions, created),
                   tuple(nodes_added), tuple(node_status), tuple(queues), tuple(respecified),
                   decisions)


def changed_workloads(
    actions: Sequence[Action], transitions: Sequence[Changed], created: Sequence[str]
) -> tuple[str, ...]:
    """The workloads whose record a batch of ``actions`` that was applied changed:
    those it transitioned, created, or named (a progress report or a priority
    change has no transition), in the order the batch first named them."""
    workloads = dict.fromkeys(c.workload.id for c in transitions)
    workloads.update(dict.fromkeys(created))
    for a in actions:
        if isinstance(a, Submit):
            continue  # its workload is among ``created``
        if isinstance(a, Preempt):
            workloads[a.victim] = None
            workloads[a.preemptor] = None
        else:
            named = getattr(a, "workload", None)
            if isinstance(named, str):
                workloads[named] = None
    return tuple(workloads)


class EffectsLog:
    """The records of applied batches, in order, for named readers (module docstring).

    Positions are counted from the first record ever kept, so a position taken
    (by a savepoint, or by a reader before it writes what it read) stays valid
    while older records are dropped."""

    __slots__ = ("_cursors", "_records", "_start")

    def __init__(self) -> None:
        self._records: list[Effects] = []
        self._start = 0  # position of _records[0]
        self._cursors: dict[str, int] = {}  # reader -> position of the first record it has not read

    # ----------------------------------------------------------------- readers
    def follow(self, reader: str) -> None:
        """Start keeping records for ``reader``, from the next one made."""
        if reader in self._cursors:
            raise ValueError(f"{reader!r} already follows this log")
        self._cursors[reader] = self.end

    def follows(self, reader: str) -> bool:
        return reader in self._cursors

    @property
    def followed(self) -> bool:
        """Whether anyone reads it (a log nobody follows keeps nothing)."""
        return bool(self._cursors)

    def __len__(self) -> int:
        """How many records are kept (those some reader has not read yet)."""
        return len(self._records)

    @property
    def end(self) -> int:
        """The position the next record will have."""
        return self._start + len(self._records)

    def unread(self, reader: str) -> tuple[Effects, ...]:
        """The records ``reader`` has not read yet, in order (it keeps them unread)."""
        return tuple(self._records[self._cursors[reader] - self._start :])

    def has_unread(self, reader: str) -> bool:
        return self._cursors[reader] < self.end

    def mark_read(self, reader: str, upto: int) -> None:
        """``reader`` has read every record before position ``upto`` (e.g. the
        :attr:`end` it saw when it took :meth:`unread`); records every reader has
        read are dropped."""
        if not self._cursors[reader] <= upto <= self.end:
            raise ValueError(f"{reader!r} cannot have read up to {upto}")
        self._cursors[reader] = upto
        first = min(self._cursors.values())
        if first > self._start:
            del self._records[: first - self._start]
            self._start = first

    def take(self, reader: str) -> tuple[Effects, ...]:
        """The records ``reader`` has not read yet, now read."""
        out = self.unread(reader)
        if out:
            self.mark_read(reader, self.end)
        return out

    # ------------------------------------------------------- the control plane
    def append(self, effects: Effects) -> None:
        if self._cursors:
            self._records.append(effects)

    def truncate(self, end: int) -> None:
        """Drop the records from position ``end`` on, for every reader (the batches
        that made them were undone). A reader that had read any of them (it made
        them durable, say, before they were undone) is set back to ``end``."""
        if end <= self._start:
            self._records.clear()
            self._start = end
        else:
            del self._records[end - self._start :]
        for reader, at in self._cursors.items():
            if at > end:
                self._cursors[reader] = end
