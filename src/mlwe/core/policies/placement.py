"""Placement policies: where the replicas of a workload go.

A policy works on a :class:`CapacityIndex` fork and places every replica of a
gang or none (what it tentatively took is given back on failure).
"""

from __future__ import annotations

from collections.abc import Container
from typing import Protocol

from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape


class PlacementPolicy(Protocol):
    name: str

    def place(
        self, fork: CapacityIndex, shape: Shape, replicas: int, exclude: Container[str] = ()
    ) -> tuple[ReplicaAlloc, ...] | None:
        """Allocate all replicas on ``fork`` and return them, or allocate nothing and return None."""
        ...


class _Packing:
    name = "best-fit"
    spread = False

    def place(
        self, fork: CapacityIndex, shape: Shape, replicas: int, exclude: Container[str] = ()
    ) -> tuple[ReplicaAlloc, ...] | None:
        taken: list[ReplicaAlloc] = []
        for _ in range(replicas):
            alloc = None
            for node in fork.candidates(shape, self.spread):
                if node in exclude:
                    continue
                alloc = fork.fit_on(node, shape)
                if alloc is not None:
                    break
            if alloc is None:
                for a in reversed(taken):
                    fork.release(a)
                return None
            fork.allocate(alloc)
            taken.append(alloc)
        return tuple(taken)


class BestFit(_Packing):
    """Best fit: the node that leaves the fewest whole GPUs free (fewest free cores
    for CPU work), least valuable adequate GPU model first. Keeps whole nodes free
    for large gangs and so reduces fragmentation."""

    name = "best-fit"
    spread = False


class Spread(_Packing):
    """Spread: the node with the most free GPUs (cores) first, to balance load."""

    name = "spread"
    spread = True
