"""Free capacity per node, indexed for fast placement, with cheap forks.

The control plane owns one :class:`CapacityIndex` and updates it as batches
are applied (free capacity is kept incrementally, never summed on read).
Policies decide on a :meth:`CapacityIndex.fork`: a copy-on-write view that
they may allocate and release on freely; it never touches its parent.

Indexes:
- GPU nodes are bucketed by (GPU model, number of wholly free GPUs), so a
  best-fit search for ``g`` GPUs walks buckets ``g, g+1, ...`` and stops at the
  first node that also has the CPU, RAM and VRAM;
- nodes with a partly used GPU are kept per model, for fractional requests;
- CPU-only nodes are bucketed by free whole cores.
Buckets are insertion-ordered dicts (never sets: string hashing is seeded
per process, and iteration order must be the same on every run).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from mlwe.core.resources import Resources
from mlwe.core.spec import NodeStatus

FULL = 1000  # milli-GPU of one device
_CPU_LEVEL_CAP = 512
#: what a device that is not partly used holds free
_WHOLE = frozenset((0, FULL))


@dataclass(frozen=True, slots=True)
class NodeInfo:
    """The static description of a node (what does not change as work comes and goes)."""

    name: str
    gpu_model: str | None
    gpu_count: int
    vram_per_gpu: int
    capacity: Resources
    labels: Mapping[str, str] = field(default_factory=dict)
    order: int = 0  # position in the cluster, for stable tie-breaks


@dataclass(frozen=True, slots=True)
class ReplicaAlloc:
    """What one replica holds on one node: devices (indices) and the resource vector."""

    node: str
    devices: tuple[int, ...]
    gpu_per_device: int
    res: Resources


@dataclass(frozen=True, slots=True)
class Shape:
    """One replica's request as the placement search sees it."""

    gpu: int  # milli-GPU: a multiple of 1000, or a fraction below 1000
    cpu: int
    ram: int
    vram: int | None  # explicit VRAM per replica, or None: proportional to the GPUs
    models: tuple[str, ...]  # acceptable GPU models in preference order (empty when gpu == 0)
    selector: tuple[tuple[str, str], ...] = ()
    # the gang's shape (WorkloadSpec.gang): replicas per node exactly (0: any), at most
    # (0: no limit), and pack/spread ("": the placement policy's own order)
    per_node: int = 0
    max_per_node: int = 0
    gang_placement: str = ""
    #: the hash, computed once: shapes key the cycle's memo tables (a generated hash
    #: would rebuild and hash the tuple of every field on each lookup)
    _hash: int = field(default=0, init=False, repr=False, compare=False)
    #: the repr, made on first use: a decision's input digest reads it for every
    #: placement, and interned shapes are few
    _text: str = field(default="", init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_hash", hash(self._fields()))

    def __repr__(self) -> str:
        # the text dataclass would generate (a test holds them equal), kept
        text = self._text
        if not text:
            text = "Shape(" + ", ".join(
                f"{name}={value!r}" for name, value in zip(_SHAPE_FIELDS, self._fields())
            ) + ")"
            object.__setattr__(self, "_text", text)
        return text

    def _fields(self) -> tuple[object, ...]:
        """The compared fields, in order (what the hash and a pickle are made of)."""
        return (self.gpu, self.cpu, self.ram, self.vram, self.models, self.selector,
                self.per_node, self.max_per_node, self.gang_placement)

    def __hash__(self) -> int:
        return self._hash

    def __reduce__(self) -> tuple[type[Shape], tuple[object, ...]]:
        # rebuilt from its fields: a string's hash differs from process to process
        return Shape, self._fields()

    @property
    def gang_shaped(self) -> bool:
        return bool(self.per_node or self.max_per_node or self.gang_placement)


_SHAPE_FIELDS = ("gpu", "cpu", "ram", "vram", "models", "selector", "per_node", "max_per_node",
                 "gang_placement")


def _key(info: NodeInfo, free: list[int], dev: list[int]) -> tuple[str, int]:
    if info.gpu_model is None:
        return ("", min(free[2] // 1000, _CPU_LEVEL_CAP))
    return (info.gpu_model, dev.count(FULL))


def _fit(info: NodeInfo, free: list[int], dev: list[int], shape: Shape) -> ReplicaAlloc | None:
    node = info.name
    if shape.selector and any(info.labels.get(k) != v for k, v in shape.selector):
        return None
    if shape.cpu > free[2] or shape.ram > free[3]:
        return None
    if shape.gpu == 0:
        return ReplicaAlloc(node, (), 0, Resources(0, 0, shape.cpu, shape.ram))
    if info.gpu_model is None or info.gpu_model not in shape.models:
        return None
    if shape.gpu >= FULL:
        g = shape.gpu // FULL
        devices: list[int] = []
        for i, d in enumerate(dev):
            if d == FULL:
                devices.append(i)
                if len(devices) == g:
                    break
        if len(devices) < g:
            return None
        vram = shape.vram if shape.vram is not None else g * info.vram_per_gpu
        if vram > free[1]:
            return None
        return ReplicaAlloc(
            node, tuple(devices), FULL, Resources(shape.gpu, vram, shape.cpu, shape.ram)
        )
    # fractional: the fullest device that still fits (packs partial devices first)
    best = -1
    best_free = FULL + 1
    for i, d in enumerate(dev):
        if shape.gpu <= d < best_free:
            best, best_free = i, d
    if best < 0:
        return None
    vram = shape.vram if shape.vram is not None else shape.gpu * info.vram_per_gpu // FULL
    if vram > free[1]:
        return None
    return ReplicaAlloc(node, (best,), shape.gpu, Resources(shape.gpu, vram, shape.cpu, shape.ram))


class CapacityIndex:
    """Free capacity of every node, with the search indexes kept up to date."""

    __slots__ = (
        "_base",
        "_buckets",
        "_by_model",
        "_dev",
        "_free",
        "_info",
        "_key",
        "_maps_owned",
        "_max_level",
        "_model_lists",
        "_owned_buckets",
        "_owned_nodes",
        "_partial",
        "_status",
        "_status_owned",
        "changes",
    )

    def __init__(self) -> None:
        self._info: dict[str, NodeInfo] = {}
        self._free: dict[str, list[int]] = {}
        self._dev: dict[str, list[int]] = {}
        self._status: dict[str, NodeStatus] = {}
        self._key: dict[str, tuple[str, int]] = {}
        self._buckets: dict[tuple[str, int], dict[str, None]] = {}
        self._partial: dict[str, dict[str, None]] = {}
        self._max_level: dict[str, int] = {}
        self._by_model: dict[str, list[str]] = {}
        #: the nodes of several models in preference order, per tuple of models (shared
        #: with forks: nodes are added and removed on the base only, which clears it)
        self._model_lists: dict[tuple[str, ...], list[str]] = {}
        #: forks share the status table until they change a node's status
        self._status_owned = True
        #: forks share the node maps and indexes until they first change capacity
        self._maps_owned = True
        self._base = True
        self._owned_nodes: set[str] = set()
        self._owned_buckets: set[tuple[str, int] | str] = set()
        #: how many times capacity or a status changed on this index (a reader that
        #: keeps what it read can tell whether it still holds)
        self.changes = 0

    # ----------------------------------------------------------------- building
    def add_node(self, info: NodeInfo, status: NodeStatus = NodeStatus.READY) -> None:
        if not self._base:
            raise RuntimeError("nodes are added to the control plane's index, not to a fork")
        if info.name in self._info:
            raise ValueError(f"node {info.name!r} already exists")
        self._info[info.name] = info
        c = info.capacity
        self._free[info.name] = [c.gpu, c.vram, c.cpu, c.ram]
        self._dev[info.name] = [FULL] * info.gpu_count
        self._status[info.name] = status
        model = info.gpu_model or ""
        level = info.gpu_count if info.gpu_model else min(c.cpu // 1000, _CPU_LEVEL_CAP)
        self._max_level[model] = max(self._max_level.get(model, 0), level)
        self._by_model.setdefault(model, []).append(info.name)
        self._model_lists.clear()
        self.changes += 1
        self._reindex(info.name)

    def remove_node(self, name: str) -> None:
        """Take back :meth:`add_node` of a node that holds nothing (an undone addition)."""
        if not self._base:
            raise RuntimeError("nodes are removed from the control plane's index, not a fork")
        info = self._info[name]
        c = info.capacity
        if self._free[name] != [c.gpu, c.vram, c.cpu, c.ram]:
            raise ValueError(f"node {name!r} holds resources; it cannot be removed")
        key = self._key.pop(name, None)
        if key is not None:
            self._buckets[key].pop(name, None)
        if info.gpu_model is not None and info.gpu_model in self._partial:
            self._partial[info.gpu_model].pop(name, None)
        self._by_model[info.gpu_model or ""].remove(name)
        self._model_lists.clear()
        del self._info[name], self._free[name], self._dev[name], self._status[name]
        self.changes += 1
        # _max_level may now overstate the largest node of the model: it only bounds searches

    def fork(self) -> CapacityIndex:
        """A copy-on-write view: changes to it never reach this index."""
        f = CapacityIndex.__new__(CapacityIndex)
        f._info = self._info  # static, shared
        # shared until the fork first changes capacity or a status (_own_maps): a
        # fork that only reads (a search that finds nothing, a cycle that places
        # nothing) copies no map of thousands of nodes; this index must not change
        # while the fork is in use (as for the per-node lists it shares anyway)
        f._free = self._free
        f._dev = self._dev
        f._key = self._key
        f._buckets = self._buckets
        f._partial = self._partial
        f._maps_owned = False
        f._status = self._status  # copied on the fork's first status change
        f._status_owned = False
        f._model_lists = self._model_lists
        f._max_level = self._max_level
        f._by_model = self._by_model
        f._base = False
        f._owned_nodes = set()
        f._owned_buckets = set()
        f.changes = 0
        return f

    # ------------------------------------------------------------------ reading
    def __contains__(self, node: str) -> bool:
        return node in self._info

    def info(self, node: str) -> NodeInfo:
        return self._info[node]

    def nodes(self) -> Iterator[NodeInfo]:
        return iter(self._info.values())

    def node_names(self) -> list[str]:
        return list(self._info)

    def status(self, node: str) -> NodeStatus:
        return self._status[node]

    def free(self, node: str) -> Resources:
        f = self._free[node]
        return Resources(f[0], f[1], f[2], f[3])

    def free_gpu(self, node: str) -> int:
        """``free(node).gpu`` (thousandths of a GPU), without building the Resources."""
        return self._free[node][0]

    def free_vector(self, node: str) -> tuple[int, int, int, int]:
        """``free(node)`` as a plain tuple (gpu, vram, cpu, ram), for hot loops."""
        f = self._free[node]
        return f[0], f[1], f[2], f[3]

    def free_devices(self, node: str) -> tuple[int, ...]:
        return tuple(self._dev[node])

    def whole_free_gpus(self, node: str) -> int:
        return self._dev[node].count(FULL)

    def has_free_gpu(self) -> bool:
        """Whether any ready node has a whole or partly free GPU (cheap: reads the
        buckets, not the nodes)."""
        for (model, level), b in self._buckets.items():
            if model and level > 0 and b:
                return True
        return any(self._partial.values())

    def most_whole_free_gpus(self) -> int:
        """The most whole free GPUs on any one ready GPU node (cheap: reads the
        buckets, not the nodes). A replica that asks for more whole GPUs than
        this fits nowhere."""
        most = 0
        for (model, level), b in self._buckets.items():
            if model and level > most and b:
                most = level
        return most

    def nodes_of_model(self, model: str | None) -> list[str]:
        """Nodes with GPUs of ``model`` (None: CPU-only nodes), in the order they were added."""
        return self._by_model.get(model or "", [])

    def nodes_of_models(self, models: tuple[str, ...]) -> list[str]:
        """The nodes of each of ``models`` in that order, then in the order they were
        added (kept until a node is added or removed; read-only)."""
        if len(models) == 1:
            return self._by_model.get(models[0], [])
        got = self._model_lists.get(models)
        if got is None:
            got = self._model_lists[models] = [
                n for m in models for n in self._by_model.get(m, [])
            ]
        return got

    def models(self) -> list[str]:
        return sorted(m for m in self._max_level if m)

    # ------------------------------------------------------------- copy-on-write
    def _own_maps(self) -> None:
        """A fork's first change: take its own node maps and indexes (the per-node
        lists and buckets inside stay shared until changed, as before)."""
        self._free = dict(self._free)
        self._dev = dict(self._dev)
        self._key = dict(self._key)
        self._buckets = dict(self._buckets)
        self._partial = dict(self._partial)
        self._maps_owned = True

    def _own_node(self, node: str) -> None:
        if not self._base and node not in self._owned_nodes:
            self._free[node] = list(self._free[node])
            self._dev[node] = list(self._dev[node])
            self._owned_nodes.add(node)

    def _bucket_w(self, key: tuple[str, int]) -> dict[str, None]:
        b = self._buckets.get(key)
        if b is None:
            b = self._buckets[key] = {}
            self._owned_buckets.add(key)
        elif not self._base and key not in self._owned_buckets:
            b = self._buckets[key] = dict(b)
            self._owned_buckets.add(key)
        return b

    def _partial_w(self, model: str) -> dict[str, None]:
        p = self._partial.get(model)
        if p is None:
            p = self._partial[model] = {}
            self._owned_buckets.add(model)
        elif not self._base and model not in self._owned_buckets:
            p = self._partial[model] = dict(p)
            self._owned_buckets.add(model)
        return p

    def _reindex(self, node: str) -> None:
        info = self._info[node]
        old = self._key.get(node)
        schedulable = self._status[node] is NodeStatus.READY
        new = _key(info, self._free[node], self._dev[node]) if schedulable else None
        if old != new:
            if old is not None:
                self._bucket_w(old).pop(node, None)
            if new is not None:
                self._bucket_w(new)[node] = None
                self._key[node] = new
            else:
                self._key.pop(node, None)
        if info.gpu_model is not None:
            # (some device partly used: every value is 0, FULL or in between)
            part = schedulable and not _WHOLE.issuperset(self._dev[node])
            current = self._partial.get(info.gpu_model)
            present = current is not None and node in current
            if part and not present:
                self._partial_w(info.gpu_model)[node] = None
            elif present and not part:
                self._partial_w(info.gpu_model).pop(node, None)

    # ----------------------------------------------------------------- changing
    def set_status(self, node: str, status: NodeStatus) -> None:
        if not self._maps_owned:
            self._own_maps()
        if not self._status_owned:
            self._status = dict(self._status)
            self._status_owned = True
        self._status[node] = status
        self.changes += 1
        self._reindex(node)

    def check(self, alloc: ReplicaAlloc) -> list[str]:
        """Reasons ``alloc`` cannot be taken from its node's free capacity (empty: it can)."""
        node = alloc.node
        if node not in self._info:
            return [f"unknown node {node!r}"]
        reasons = []
        free = self._free[node]
        need = alloc.res
        for name, have, want in zip(("gpu", "vram", "cpu", "ram"), free, need.as_tuple()):
            if want > have:
                reasons.append(f"node {node}: {name} {want} requested, {have} free")
        dev = self._dev[node]
        if len(set(alloc.devices)) != len(alloc.devices):
            reasons.append(f"node {node}: a device is listed twice")
        for d in alloc.devices:
            if not 0 <= d < len(dev):
                reasons.append(f"node {node}: no GPU device {d}")
            elif dev[d] < alloc.gpu_per_device:
                reasons.append(
                    f"node {node}: GPU {d} has {dev[d]} milli free, {alloc.gpu_per_device} asked"
                )
        if alloc.gpu_per_device * len(alloc.devices) != need.gpu:
            reasons.append(f"node {node}: devices do not add up to the {need.gpu} milli-GPU asked")
        return reasons

    def allocate(self, alloc: ReplicaAlloc) -> None:
        node = alloc.node
        if not self._maps_owned:
            self._own_maps()
        self._own_node(node)
        free = self._free[node]
        r = alloc.res
        free[0] -= r.gpu
        free[1] -= r.vram
        free[2] -= r.cpu
        free[3] -= r.ram
        dev = self._dev[node]
        for d in alloc.devices:
            dev[d] -= alloc.gpu_per_device
        self.changes += 1
        self._reindex(node)

    def release(self, alloc: ReplicaAlloc) -> None:
        node = alloc.node
        if not self._maps_owned:
            self._own_maps()
        self._own_node(node)
        free = self._free[node]
        r = alloc.res
        free[0] += r.gpu
        free[1] += r.vram
        free[2] += r.cpu
        free[3] += r.ram
        dev = self._dev[node]
        for d in alloc.devices:
            dev[d] += alloc.gpu_per_device
        self.changes += 1
        self._reindex(node)

    # ------------------------------------------------------------------ search
    def fit_on(self, node: str, shape: Shape) -> ReplicaAlloc | None:
        """The allocation ``shape`` would get on ``node`` now, or None if it does not fit."""
        if self._status[node] is not NodeStatus.READY:
            return None
        return _fit(self._info[node], self._free[node], self._dev[node], shape)

    def fit_after_release(
        self, node: str, shape: Shape, released: list[ReplicaAlloc]
    ) -> ReplicaAlloc | None:
        """What ``fit_on`` would answer if ``released`` were given back first (changes nothing)."""
        if self._status[node] is not NodeStatus.READY:
            return None
        free = list(self._free[node])
        dev = list(self._dev[node])
        for a in released:
            r = a.res
            free[0] += r.gpu
            free[1] += r.vram
            free[2] += r.cpu
            free[3] += r.ram
            for d in a.devices:
                dev[d] += a.gpu_per_device
        return _fit(self._info[node], free, dev, shape)

    def candidates(self, shape: Shape, spread: bool = False) -> Iterator[str]:
        """Nodes worth trying for ``shape``, best fit first (most free first when ``spread``).

        Do not allocate or release while iterating: the buckets move under you.

        Only nodes that can possibly fit the GPU part are yielded; CPU, RAM and
        VRAM are checked by :meth:`fit_on`.
        """
        buckets = self._buckets
        if shape.gpu == 0:
            need = shape.cpu // 1000
            top = self._max_level.get("", -1)
            levels = (
                range(top, need - 1, -1) if spread else range(min(need, _CPU_LEVEL_CAP), top + 1)
            )
            for lv in levels:
                b = buckets.get(("", lv))
                if b:
                    yield from b
            # CPU work may use the spare CPU of GPU nodes, busiest first
            for model in self.models():
                for lv in range(0, self._max_level[model] + 1):
                    b = buckets.get((model, lv))
                    if b:
                        yield from b
            return
        if shape.gpu < FULL:
            for model in shape.models:
                p = self._partial.get(model)
                if p:
                    yield from p
            g = 1
        else:
            g = shape.gpu // FULL
        top = max((self._max_level.get(m, -1) for m in shape.models), default=-1)
        levels = range(top, g - 1, -1) if spread else range(g, top + 1)
        for lv in levels:
            for model in shape.models:
                b = buckets.get((model, lv))
                if b:
                    yield from b

    def find(self, shape: Shape, spread: bool = False, limit: int = 0) -> ReplicaAlloc | None:
        """The best-fit allocation for ``shape`` (None: nothing fits now).

        ``limit`` bounds how many candidate nodes are examined (0: no bound).
        """
        seen = 0
        for node in self.candidates(shape, spread):
            alloc = self.fit_on(node, shape)
            if alloc is not None:
                return alloc
            seen += 1
            if limit and seen >= limit:
                return None
        return None

    # -------------------------------------------------------------- invariants
    def recompute_keys_ok(self) -> list[str]:
        """Index self-consistency (used by the invariant sweep)."""
        problems = []
        for node, info in self._info.items():
            schedulable = self._status[node] is NodeStatus.READY
            expect = _key(info, self._free[node], self._dev[node]) if schedulable else None
            if self._key.get(node) != expect:
                problems.append(f"node {node}: index key {self._key.get(node)} != {expect}")
            elif expect is not None and node not in self._buckets.get(expect, {}):
                problems.append(f"node {node}: missing from bucket {expect}")
        for key, b in self._buckets.items():
            for node in b:
                if self._key.get(node) != key:
                    problems.append(f"node {node}: stale entry in bucket {key}")
        return problems
