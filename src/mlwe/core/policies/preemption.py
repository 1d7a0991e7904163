"""Victim selection: whom to evict so that a more urgent workload fits.

Semantics (DESIGN.md): only a strictly higher priority preempts (or a queue
reclaiming nominal quota it lent to its cohort); a victim is chosen only if
evicting it frees what the preemptor needs on a node where the preemptor
then fits; protected workloads and those under their minimum runtime or
minimum progress are never victims; among valid victim sets the cheapest is
chosen, and the set is minimal (no victim can be dropped).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Mapping
from dataclasses import dataclass, field
from typing import Protocol

from mlwe.core.actions import PreemptReason
from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.core.resources import format_duration
from mlwe.core.rules import frees_what_is_needed, gain_allowed, preemptible
from mlwe.core.spec import NodeStatus

#: A CPU-only victim's cores are weighed as GPUs at this rate (8 cores ~ 1 GPU).
CORES_PER_GPU_EQUIVALENT = 8.0
EVICTABLE = (State.ADMITTED, State.STARTING, State.RUNNING)
#: what breaking a gang costs on top of its lost work, in GPU-seconds (victim
#: searches and the gain test both charge it)
GANG_PENALTY_GPU_S = 3600.0
_EVICTABLE = frozenset(EVICTABLE)


@dataclass(frozen=True, slots=True)
class VictimChoice:
    victims: tuple[tuple[Workload, PreemptReason], ...]
    allocs: tuple[ReplicaAlloc, ...]  # where the preemptor goes once the victims are gone
    cost: float  # GPU-seconds: lost work + restart, plus gang penalties
    nodes_examined: int
    feasible_nodes: int
    alternatives: tuple[str, ...] = ()  # the next-cheapest candidate sets, described
    reasons: tuple[str, ...] = field(default=())


class PreemptionPolicy(Protocol):
    name: str

    def select(
        self,
        cp: ControlPlane,
        fork: CapacityIndex,
        p: Workload,
        shape: Shape,
        taken: set[str],
        exclude: Container[str] = (),
    ) -> VictimChoice | None:
        """Victims to evict so ``p`` fits, never on ``exclude`` nodes (None: no valid set)."""
        ...


def exposure(v: Workload, now: float) -> tuple[float, float]:
    """Seconds of running holder ``v``'s work at risk at ``now`` (since its last
    checkpoint, or its start), and seconds to its next checkpoint (0.0 if it
    takes none): inline, v.work_at_risk(now) and v.next_checkpoint(now) - now
    (tests/core/test_cycle_costs.py holds them equal)."""
    started = v.started_at
    assert started is not None
    spec = v.spec
    iv = spec.checkpoint_interval
    ckpt = v.last_checkpoint_at
    wait = 0.0
    if iv:
        begin = started + (spec.restart_cost if v.run_base_work > 0 else 0.0)
        period = iv + spec.checkpoint_cost
        # (max() spelt out as comparisons here: a cycle asks this of thousands)
        ran = now - begin
        n = int((ran if ran > 0.0 else 0.0) // period)
        if n > 0:
            t = begin + n * period
            ckpt = t if ckpt is None or t > ckpt else ckpt
        wait = begin + (n + 1) * period - now
    risk = now - (ckpt if ckpt is not None else started)
    return (risk if risk > 0.0 else 0.0), wait


def victim_cost(v: Workload, now: float, gang_penalty: float) -> float:
    """GPU-seconds lost by evicting ``v`` now: work since its last checkpoint plus
    its restart cost, on all its GPUs, plus a penalty if it is a gang."""
    spec = v.spec
    gpus = spec.resources.gpu * spec.replicas / 1000  # v.gpus(), read once
    if gpus == 0:
        gpus = spec.resources.cpu * spec.replicas / 1000 / CORES_PER_GPU_EQUIVALENT
    # v.work_at_risk(now): a victim search asks this of every holder it examines
    risk = exposure(v, now)[0] if v.started_at is not None else 0.0
    return gpus * (risk + spec.restart_cost) + (gang_penalty if spec.replicas > 1 else 0.0)


@dataclass(slots=True)
class _Candidate:
    node: str
    victims: list[tuple[float, Workload, PreemptReason]]
    alloc: ReplicaAlloc
    cost: float
    rank: int
    _key: tuple[float, int, int, int] | None = None

    def key(self) -> tuple[float, int, int, int]:
        if self._key is None:
            top = max(v.priority for _, v, _ in self.victims)
            self._key = (round(self.cost, 6), top, len(self.victims), self.rank)
        return self._key


@dataclass(slots=True)
class _Search:
    """What a victim search has chosen so far, over the preemptor's replicas."""

    chosen: dict[str, tuple[Workload, PreemptReason]] = field(default_factory=dict)
    allocs: list[ReplicaAlloc] = field(default_factory=list)
    per_node: dict[str, int] = field(default_factory=dict)
    total_cost: float = 0.0
    examined: int = 0
    feasible_total: int = 0
    alternatives: list[str] = field(default_factory=list)

    def place(self, alloc: ReplicaAlloc) -> None:
        self.allocs.append(alloc)
        self.per_node[alloc.node] = self.per_node.get(alloc.node, 0) + 1

    def note_alternatives(self, best: _Candidate, found: list[_Candidate]) -> None:
        """The next-cheapest candidates (three at most, over all replicas), described."""
        for c in sorted(found, key=_Candidate.key):
            if c is not best and len(self.alternatives) < 3:
                self.alternatives.append(
                    f"{c.node}: {c.cost / 60:.0f} GPU-min"
                    f" ({', '.join(v.id for _, v, _ in c.victims)})"
                )


def candidate_nodes(fork: CapacityIndex, shape: Shape) -> list[str]:
    """Where a replica of ``shape`` might go: the nodes of its models in preference
    order; for CPU-only work, CPU nodes first, then every GPU model's nodes.
    Read-only: the index's own list, kept (not rebuilt for every search)."""
    if shape.gpu:
        return fork.nodes_of_models(shape.models)
    nodes = [*fork.nodes_of_model(None)]
    for m in fork.models():
        nodes += fork.nodes_of_model(m)
    return nodes


def _eligibility(
    cp: ControlPlane,
    p: Workload,
    taken: set[str],
    equals: Callable[[Workload], bool] | None,
    reclaim_ok: bool,
    now: float,
) -> Callable[[Workload], PreemptReason | None]:
    """The test a running workload passes to be a victim of ``p``, returning the
    reason it may be evicted (None: it may not): strictly lower priority, an equal
    worth evicting (``equals``), or a cohort member over its nominal quota while
    ``p`` reclaims; never protected or too young work, never work that frees
    nothing ``p`` can use."""
    qp = cp.queues[p.queue]
    mine = p.priority
    capacity = cp.capacity
    evictable = _EVICTABLE
    by_priority = PreemptReason.PRIORITY

    def eligible(v: Workload) -> PreemptReason | None:
        # runs for every holder of every node a search examines: the cheap tests first
        if v.state not in evictable or v.id in taken:
            return None
        po = v.priority_override
        theirs = v.spec.priority if po is None else po  # v.priority
        if theirs < mine:
            why = by_priority
        elif equals is not None and theirs == mine:
            if not (gain_allowed(p, v, now) and equals(v)):
                return None
            why = PreemptReason.GAIN
        elif reclaim_ok:
            qv = cp.queues[v.queue]
            if not (qv.cohort == qp.cohort and qv.name != qp.name and qv.over_nominal()):
                return None
            why = PreemptReason.RECLAIM
        else:
            return None
        if preemptible(v, now) is not None:
            return None
        if not frees_what_is_needed(capacity, v, p):
            return None  # the control plane's rule: e.g. a CPU-only job frees no GPUs
        return why

    return eligible


def _free_fit(
    f: CapacityIndex,
    shape: Shape,
    exclude: Container[str],
    per_node: Mapping[str, int],
    cap: int,
) -> tuple[ReplicaAlloc | None, Container[str]]:
    """Room for one more replica without evicting anyone, and the nodes the victim
    scan must then avoid: ``exclude``, plus, for a shaped gang, the nodes at its cap."""
    if not cap:
        return _first_fit(f, shape, exclude), exclude
    # nodes at the gang's cap take no more of it; with tasks_per_node, the
    # node being filled is tried first, so the gang fills it before the next
    full = {n for n, c in per_node.items() if c >= cap}
    excl: Container[str] = _Either(exclude, full)
    filling = [n for n, c in per_node.items() if c < cap]
    free_alloc = (f.fit_on(filling[-1], shape)
                  if shape.per_node and filling and filling[-1] not in exclude
                  else None) or _first_fit(f, shape, excl)
    return free_alloc, excl


class CheapestVictims:
    """Cheapest minimal victim set per replica, over a bounded set of candidate nodes.

    Nodes are examined from a rotating start until ``max_candidates`` nodes on
    which the preemptor would fit have been found (or ``max_scan`` examined),
    as kube-scheduler's DefaultPreemption bounds its dry runs; the cheapest of
    those wins. On each node, victims are added cheapest first until the
    preemptor fits, then any victim whose return still leaves room is dropped,
    so the set is minimal.
    """

    name = "cheapest-victims"

    def __init__(
        self,
        max_candidates: int = 16,
        max_scan: int = 1024,
        gang_penalty_gpu_s: float = GANG_PENALTY_GPU_S,
    ) -> None:
        self.max_candidates = max_candidates
        self.max_scan = max_scan
        self.gang_penalty = gang_penalty_gpu_s
        self._cursor = 0

    def select(
        self,
        cp: ControlPlane,
        fork: CapacityIndex,
        p: Workload,
        shape: Shape,
        taken: set[str],
        exclude: Container[str] = (),
        equals: Callable[[Workload], bool] | None = None,
        within: Container[str] | None = None,
    ) -> VictimChoice | None:
        """As the protocol says; ``equals`` (optional) admits victims of the
        preemptor's own priority for which it returns True (reason "gain").
        ``within`` (optional): the caller knows that no node outside it holds a
        victim set, nor a victim that ``equals`` should see first there (see
        :meth:`mlwe.core.gain.GainPool.reach`); the scan then counts those nodes
        (the rotating start and the ranks are as without it) but reads none of
        their holders."""
        now = cp.now()
        qp = cp.queues[p.queue]
        after = [u + r for u, r in zip(qp.usage, p.request().as_tuple())]
        reclaim_ok = qp.cohort is not None and all(
            a <= n for a, n in zip(after, qp.nominal.as_tuple())
        )
        held = cp.holding_by_priority  # live priorities only (zero counts are dropped)
        lowest = min(held, default=p.priority + 1)
        if not reclaim_ok and (lowest > p.priority or (lowest == p.priority and equals is None)):
            return None  # nobody holds anything at a lower (or, among equals, the same) priority
        nodes = candidate_nodes(fork, shape)
        if not nodes:
            return None
        eligible = _eligibility(cp, p, taken, equals, reclaim_ok, now)
        return self._search(cp, fork, p, shape, nodes, exclude, eligible, now, within)

    def pass_over(
        self,
        fork: CapacityIndex,
        shape: Shape,
        replicas: int = 1,
        exclude: Container[str] = (),
    ) -> bool:
        """Account for a search for ``replicas`` of ``shape`` (no per-node cap) that
        the caller knows finds no victim, as if it had run: the replicas that fit
        in free room take it, and the first that does not scans every candidate
        node, which moves the rotating start by their count. True if that scan
        happens (the search then reads its victim test on every holder there);
        False if every replica fits without evicting anyone (nothing moves).

        One replica is known not to fit (the caller's placement failed); for a
        gang, the search's own first fits are replayed on a copy of ``fork``.
        The caller checks that a gang's candidate nodes number at most
        ``max_scan``; one replica's scan examines at most ``max_scan`` of them
        (:meth:`window`).
        """
        nodes = candidate_nodes(fork, shape)
        assert replicas == 1 or len(nodes) <= self.max_scan, (
            "a gang's search stops before it has seen every node"
        )
        if replicas > 1:
            f = fork.fork()
            for _ in range(replicas):
                alloc = _first_fit(f, shape, exclude)
                if alloc is None:
                    break
                f.allocate(alloc)
            else:
                return False
        self._cursor += min(len(nodes), self.max_scan)
        return True

    def window(self, nodes: list[str]) -> tuple[int, list[str]]:
        """The rotating start in ``nodes`` (a search's candidate nodes) and the nodes
        the next scan examines if it finds fewer than ``max_candidates``: from the
        start, wrapping, ``max_scan`` of them at most (as :meth:`_scan` walks them)."""
        n = len(nodes)
        start = self._cursor % n
        end = start + min(n, self.max_scan)
        return start, nodes[start:end] + nodes[: max(0, end - n)]

    def _search(
        self,
        cp: ControlPlane,
        f: CapacityIndex,
        p: Workload,
        shape: Shape,
        nodes: list[str],
        exclude: Container[str],
        eligible: Callable[[Workload], PreemptReason | None],
        now: float,
        within: Container[str] | None = None,
    ) -> VictimChoice | None:
        """Replica by replica: free room if there is some, else the cheapest candidate
        node's victims (None: some replica finds neither). ``f`` is never changed:
        what a replica takes (and its victims give back) is taken on a fork of it,
        made only when another replica is still to be placed after it (one fork
        fewer per search of one replica: thousands of nodes copied for nothing)."""
        s = _Search()
        cap = shape.per_node or shape.max_per_node  # a shaped gang: replicas per node
        replicas = p.spec.replicas
        forked = False
        for k in range(replicas):
            last = k == replicas - 1
            if not (last or forked):
                f, forked = f.fork(), True
            free_alloc, excl = _free_fit(f, shape, exclude, s.per_node, cap)
            if free_alloc is not None:
                if not last:
                    f.allocate(free_alloc)
                s.place(free_alloc)
                continue
            best, found, scanned = self._scan(
                cp, f, nodes, shape, excl, s.chosen, eligible, now, within
            )
            s.examined += scanned
            s.feasible_total += len(found)
            if best is None:
                return None
            s.note_alternatives(best, found)
            for _, v, why in best.victims:
                s.chosen[v.id] = (v, why)
                if not last:
                    for a in v.placement:  # a gang victim frees every replica
                        f.release(a)
            if not last:
                f.allocate(best.alloc)
            s.place(best.alloc)
            s.total_cost += best.cost
        if not s.chosen:
            return None  # everything fits without evicting anyone
        if p.spec.gang is not None and p.spec.gang.per_node_problems(s.per_node):
            return None  # no victim set found that gives the gang its shape
        return VictimChoice(
            victims=tuple(s.chosen.values()),
            allocs=tuple(s.allocs),
            cost=s.total_cost,
            nodes_examined=s.examined,
            feasible_nodes=s.feasible_total,
            alternatives=tuple(s.alternatives),
        )

    def _scan(
        self,
        cp: ControlPlane,
        f: CapacityIndex,
        nodes: list[str],
        shape: Shape,
        excl: Container[str],
        chosen: Mapping[str, object],
        eligible: Callable[[Workload], PreemptReason | None],
        now: float,
        within: Container[str] | None = None,
    ) -> tuple[_Candidate | None, list[_Candidate], int]:
        """One replica's dry runs: nodes from the rotating cursor, until
        ``max_candidates`` nodes where it would fit (or ``max_scan`` examined);
        the cheapest candidate, all of them, and how many nodes were examined
        (those outside ``within`` count as examined, unread)."""
        best: _Candidate | None = None
        found: list[_Candidate] = []
        _, window = self.window(nodes)  # (what a gain test reads for such a scan)
        scanned = 0
        holders, workloads, status = cp.on_node.get, cp.workloads, f.status
        ready = NodeStatus.READY
        for i, node in enumerate(window):
            scanned = i + 1
            if (
                node not in excl
                and (within is None or node in within)
                and status(node) is ready
            ):
                vs = []
                for wid in holders(node, ()):
                    if wid in chosen:
                        continue
                    v = workloads[wid]
                    why = eligible(v)
                    if why is not None:
                        vs.append((v, why))
                if vs:
                    cand = self._try_node(f, node, shape, vs, i, now)
                    if cand is not None:
                        found.append(cand)
                        if best is None or cand.key() < best.key():
                            best = cand
                        if len(found) >= self.max_candidates:
                            break
        self._cursor += scanned
        return best, found, scanned

    def cost(self, v: Workload, now: float) -> float:
        """What evicting ``v`` now costs (the set with the least total wins)."""
        return victim_cost(v, now, self.gang_penalty)

    def _try_node(
        self,
        f: CapacityIndex,
        node: str,
        shape: Shape,
        eligible: list[tuple[Workload, PreemptReason]],
        rank: int,
        now: float,
    ) -> _Candidate | None:
        # work with sums first (cheap); the victims' costs only when evicting all of
        # them would free enough (most nodes a long scan passes are short of it);
        # devices and VRAM only when the sums allow
        g0, _, c0, r0 = f.free_vector(node)
        need_g, need_c, need_r = shape.gpu, shape.cpu, shape.ram
        sizes: dict[str, tuple[int, int, int]] = {}
        tg, tc, tr = g0, c0, r0
        for v, _ in eligible:
            g = c = r = 0
            for a in v.placement:
                if a.node == node:
                    res = a.res
                    g += res.gpu
                    c += res.cpu
                    r += res.ram
            sizes[v.id] = (g, c, r)
            tg += g
            tc += c
            tr += r
        if tg < need_g or tc < need_c or tr < need_r:
            return None  # even evicting every eligible victim would not free enough
        cost = self.cost
        vs = [(cost(v, now), v, why) for v, why in eligible]
        vs.sort(key=lambda t: (t[0], t[1].priority, t[1].seq))

        def mine(items: list[tuple[float, Workload, PreemptReason]]) -> list[ReplicaAlloc]:
            return [a for _, v, _ in items for a in v.placement if a.node == node]

        released: list[tuple[float, Workload, PreemptReason]] = []
        fit = None
        g, c, r = g0, c0, r0
        for item in vs:  # cheapest first, until the preemptor fits
            released.append(item)
            hg, hc, hr = sizes[item[1].id]
            g += hg
            c += hc
            r += hr
            if g >= need_g and c >= need_c and r >= need_r:
                fit = f.fit_after_release(node, shape, mine(released))
                if fit is not None:
                    break
        if fit is None:
            return None
        # minimality: drop any victim the preemptor does not need, costliest first
        for item in sorted(released, key=lambda t: (-t[0], -t[1].seq)):
            hg, hc, hr = sizes[item[1].id]
            if (
                len(released) > 1
                and g - hg >= need_g
                and c - hc >= need_c
                and r - hr >= need_r
            ):
                trial = [x for x in released if x is not item]
                again = f.fit_after_release(node, shape, mine(trial))
                if again is not None:
                    released, fit = trial, again
                    g, c, r = g - hg, c - hc, r - hr
        return _Candidate(node, released, fit, sum(cost for cost, _, _ in released), rank)


class LowestPriorityVictims(CheapestVictims):
    """The victims are the running workloads last in priority order: lowest
    effective priority first, latest arrival first among equals; the set is still
    minimal and respects every rule of the core (strictly lower priority,
    protection, minimum runtime). For policies whose preemption is free (the
    Tiresias authors' simulator): with nothing lost, the rank is all there is to
    weigh, and the authors' simulators evict exactly the jobs that fall out of
    the policy's order."""

    name = "lowest-priority-victims"

    def cost(self, v: Workload, now: float) -> float:
        # whole numbers (the candidate key rounds costs): priority first, then recency
        return float(v.priority) * 1e9 - float(v.seq)


class _Either:
    """Membership in either of two containers (the caller's exclusions, the full nodes)."""

    def __init__(self, a: Container[str], b: Container[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, x: object) -> bool:
        return x in self.a or x in self.b


def _first_fit(f: CapacityIndex, shape: Shape, exclude: Container[str]) -> ReplicaAlloc | None:
    for node in f.candidates(shape):
        if node not in exclude:
            alloc = f.fit_on(node, shape)
            if alloc is not None:
                return alloc
    return None


def describe_choice(p: Workload, choice: VictimChoice, cp: ControlPlane) -> list[str]:
    """Readable reasons, one per victim, in the decision log's words."""
    now = cp.now()
    out = []
    nodes = sorted({a.node for a in choice.allocs})
    model = cp.capacity.info(choice.allocs[0].node).gpu_model if choice.allocs else None
    need = p.spec.resources.gpu * p.spec.replicas / 1000
    what = f"{need:g} x {model}" if p.spec.resources.gpu and model else "cpu/memory"
    dl = ""
    if p.deadline is not None:
        dl = f", deadline in {format_duration(p.deadline - now)}"
    for v, why in choice.victims:
        lost = v.gpus() * v.work_at_risk(now) / 60
        where = ",".join(sorted({a.node for a in v.placement}))
        if why is PreemptReason.PRIORITY:
            rule = f"priority {v.priority} < {p.priority}"
        elif why is PreemptReason.GAIN:
            rule = f"equal priority {v.priority}: the expected gain exceeds the cost"
        else:
            rule = f"queue {v.queue} borrows quota that {p.queue} reclaims"
        out.append(
            f"preempt {v.id} (priority {v.priority}) on {where} to free {what} for {p.id}"
            f" (priority {p.priority}{dl}); {rule}; lost work {lost:.0f} GPU-min since last"
            " checkpoint"
        )
    alt = "; ".join(choice.alternatives) if choice.alternatives else "none found"
    out.append(
        f"set cost {choice.cost / 60:.0f} GPU-min on {', '.join(nodes)}; examined"
        f" {choice.nodes_examined} nodes, {choice.feasible_nodes} feasible; cheaper than"
        f" alternatives [{alt}]"
    )
    return out
