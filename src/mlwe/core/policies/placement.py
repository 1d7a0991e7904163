"""Placement policies: where the replicas of a workload go.

A policy works on a :class:`CapacityIndex` fork and places every replica of a
gang or none (what it tentatively took is given back on failure). A gang with a
shape (``WorkloadSpec.gang``: ``tasks_per_node``, ``max_replicas_per_node``,
pack or spread) is placed by :func:`place_shaped` under every policy.
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
        if shape.gang_shaped:
            spread = (shape.gang_placement == "spread" if shape.gang_placement
                      else self.spread)
            return place_shaped(fork, shape, replicas, exclude, spread=spread)
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


def place_shaped(
    fork: CapacityIndex, shape: Shape, replicas: int, exclude: Container[str] = (),
    *, spread: bool = False,
) -> tuple[ReplicaAlloc, ...] | None:
    """Place a shaped gang whole on ``fork``, or nothing.

    - ``per_node`` (tasks_per_node) k: ``replicas / k`` nodes with exactly k each;
      pack takes the best-fit nodes that hold k, spread the emptiest;
    - otherwise at most ``max_per_node`` per node: pack fills node after node,
      emptiest first (so the gang uses few nodes); spread puts one replica per
      node per round, emptiest first, and goes round again while some remain.
    """
    # pack with tasks_per_node: best fit; otherwise the emptiest nodes first
    order = [n for n in fork.candidates(shape, spread or not shape.per_node)
             if n not in exclude]
    taken: list[ReplicaAlloc] = []

    def give_back() -> None:
        for a in reversed(taken):
            fork.release(a)

    def take(node: str, n: int) -> int:
        got = 0
        while got < n:
            alloc = fork.fit_on(node, shape)
            if alloc is None:
                break
            fork.allocate(alloc)
            taken.append(alloc)
            got += 1
        return got

    k = shape.per_node
    if k:
        for node in order:
            if len(taken) == replicas:
                break
            before = len(taken)
            if take(node, k) < k:
                for a in reversed(taken[before:]):
                    fork.release(a)
                del taken[before:]
        if len(taken) < replicas:
            give_back()
            return None
        return tuple(taken)
    cap = shape.max_per_node or replicas
    counts = dict.fromkeys(order, 0)
    if spread:
        progress = True
        while len(taken) < replicas and progress:
            progress = False
            for node in order:
                if len(taken) == replicas:
                    break
                if counts[node] < cap and take(node, 1):
                    counts[node] += 1
                    progress = True
    else:
        for node in order:
            if len(taken) == replicas:
                break
            counts[node] += take(node, min(cap, replicas - len(taken)))
    if len(taken) < replicas:
        give_back()
        return None
    # replicas in node order: a gang's ranks on one node are neighbours
    rank = {n: i for i, n in enumerate(order)}
    return tuple(sorted(taken, key=lambda a: rank[a.node]))
