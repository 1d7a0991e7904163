"""Preemption among equals, when it pays: which running workloads of a waiting
workload's own priority are worth evicting for it, judged on expected remaining
run times (learned, or the user's), against what the eviction costs.
"""

from __future__ import annotations

import heapq
import inspect
import math
from bisect import bisect_left, insort
from collections import deque
from collections.abc import Callable, Container, Iterator, Sequence
from functools import lru_cache
from operator import itemgetter
from typing import TYPE_CHECKING, NamedTuple

from mlwe.core.capacity import CapacityIndex, ReplicaAlloc, Shape
from mlwe.core.controlplane import ControlPlane
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.core.policies.deadline import INF
from mlwe.core.policies.ordering import attained
from mlwe.core.policies.preemption import (
    EVICTABLE,
    GANG_PENALTY_GPU_S,
    PreemptionPolicy,
    VictimChoice,
    candidate_nodes,
    exposure,
)
from mlwe.core.resources import format_duration
from mlwe.core.rules import GAIN_MAX_PREEMPTIONS, GAIN_MIN_QUANTUM_S
from mlwe.core.spec import NodeStatus

if TYPE_CHECKING:
    from mlwe.core.scheduler import SchedulerConfig

#: the states a victim may be in, as a set (the pool tests every holder of a cycle)
_EVICTABLE_STATES = frozenset(EVICTABLE)

#: victims, expected gain and cost (GPU-seconds), and the reason text
GainChoice = tuple[VictimChoice, float, float, str]


class Rewaits:
    """How long evicted workloads waited before they were placed again, learned
    from the restarts seen so far: what a gain decision takes as the delay of a
    victim it evicts now, instead of assuming the victim resumes as soon as its
    preemptor ends.

    Under a size-aware order an evicted workload goes back behind everything
    that has had less service than it, so the more service it has had, the
    longer it waits: the waits are kept per priority and per the evicted
    workload's saved service in GPU-seconds, in powers of two. A wait is read
    only once the workload has been placed again (from its history), so what
    is learned is what a scheduler has seen, never how long a workload still
    waiting will wait. Each class keeps its latest :attr:`KEEP` waits.

    Counted only with ``SchedulerConfig.gain_rewait_quantile`` set (the replay
    policy ``mlwe-rewait``; the default leaves it off: README, the p99 anatomy)."""

    __slots__ = ("_order", "_seen", "_sorted")

    #: waits kept per class (the oldest is forgotten first)
    KEEP = 512
    #: placements kept to tell a restart already learned (then forgotten at once)
    SEEN = 1 << 18

    def __init__(self) -> None:
        #: (workload id, moment of its eviction) already learned
        self._seen: set[tuple[str, float]] = set()
        #: (priority, service class) -> waits in arrival order, and the same sorted
        self._order: dict[tuple[int, int], deque[float]] = {}
        self._sorted: dict[tuple[int, int], list[float]] = {}

    @staticmethod
    def service_class(gpu_s: float) -> int:
        """The class of ``gpu_s`` GPU-seconds of saved service: floor(log2(1 + gpu_s))
        (0 for none, or for a figure that is not a finite positive number)."""
        if not gpu_s > 0.0:
            return 0
        if not gpu_s < 2.0**62:
            return 62
        return int(math.log2(1.0 + gpu_s))

    def observe(self, v: Workload) -> None:
        """Learn ``v``'s wait since its last eviction, if it has been placed again
        since (and that wait is not learned yet)."""
        if not v.preemptions:
            return
        placed = None
        for t in reversed(v.history):
            if t.target is State.PREEMPTED:
                break
            if t.target is State.ADMITTED:
                placed = t.time
        else:
            return
        if placed is None:
            return
        key = (v.id, t.time)
        if key in self._seen:
            return
        if len(self._seen) >= self.SEEN:
            self._seen.clear()
        self._seen.add(key)
        # what it had saved when it was evicted: what its current run resumed
        # from, or, not started yet, all it has saved
        base = v.work_done if v.started_at is None else v.run_base_work
        self.record(v.priority, max(v.gpus(), 1e-3) * base, placed - t.time)

    def record(self, priority: int, gpu_s: float, wait: float) -> None:
        """Learn that a workload of ``priority`` evicted with ``gpu_s`` GPU-seconds of
        saved service waited ``wait`` seconds to be placed again (a wait that is
        not a finite number is not learned; a negative one counts as 0.0)."""
        if not math.isfinite(wait):
            return
        wait = max(0.0, wait)
        cls = (priority, self.service_class(gpu_s))
        order = self._order.get(cls)
        if order is None:
            order = self._order[cls] = deque()
            self._sorted[cls] = []
        waits = self._sorted[cls]
        if len(order) >= self.KEEP:
            del waits[bisect_left(waits, order.popleft())]
        order.append(wait)
        insort(waits, wait)

    def waits(self, priority: int, gpu_s: float) -> list[float]:
        """The waits learned for workloads of ``priority`` evicted with ``gpu_s``
        GPU-seconds of saved service (sorted; a copy)."""
        return list(self._sorted.get((priority, self.service_class(gpu_s)), ()))

    def expect(self, priority: int, gpu_s: float, quantile: float, min_runs: int) -> float:
        """The ``quantile`` of those waits, or 0.0 with fewer than ``min_runs`` of them."""
        waits = self._sorted.get((priority, self.service_class(gpu_s)))
        if waits is None or len(waits) < max(1, min_runs):
            return 0.0
        return waits[min(len(waits) - 1, int(quantile * len(waits)))]


def saved_gpu_s(v: Workload, now: float) -> float:
    """The service ``v`` would keep if evicted now, in GPU-seconds: its GPUs x the
    work it has done less what it would lose (the class :class:`Rewaits` reads)."""
    return max(v.gpus(), 1e-3) * max(0.0, attained(v, now) - v.work_at_risk(now))


def victim_rewait(cfg: SchedulerConfig, rewaits: Rewaits | None, v: Workload, now: float) -> float:
    """What a gain decision takes as ``v``'s wait to be placed again if evicted now
    (:class:`Rewaits` at ``cfg.gain_rewait_quantile``; 0.0 when that is off, or with
    too little learned)."""
    q = cfg.gain_rewait_quantile
    if q is None or rewaits is None:
        return 0.0
    return rewaits.expect(v.priority, saved_gpu_s(v, now), q, cfg.gain_rewait_min_runs)


def expected_left(
    remaining: Callable[[Workload, float], float | None], x: Workload, now: float, prior_s: float
) -> float:
    """What gain decisions take as ``x``'s remaining run time: the learned (or the
    user's) estimate; with neither, the heavy-tail prior of least attained service
    (as long again as it has run, and at least ``prior_s``)."""
    r = remaining(x, now)
    return r if r is not None else max(attained(x, now), prior_s)


def resume_quantum(v: Workload, share: float) -> float:
    """Seconds ``v``'s current run must last before it may be a victim among equals:
    the core's minimum quantum (:data:`mlwe.core.rules.GAIN_MIN_QUANTUM_S`) and,
    for a run that resumed from saved service (after an eviction, a preemption
    or a failure), ``share`` x that service (``SchedulerConfig.gain_quantum_share``).

    A policy's bound, stricter than the core's rule: a long job evicted late is
    not evicted again soon after each restart (an MLFQ's lower queues get longer
    quanta likewise). Under a size-aware order an evicted long job goes back
    behind everything shorter, so each eviction costs it a long wait; on
    Philly's contended inputs (README, "Policy quality") the tail was made of
    such jobs, evicted five times at the median."""
    q = share * v.run_base_work
    return q if q > GAIN_MIN_QUANTUM_S else GAIN_MIN_QUANTUM_S


def rested(v: Workload, now: float, share: float) -> bool:
    """Whether ``v``'s current run has lasted its :func:`resume_quantum` by ``now``
    (one not started has run 0 s: never, as the quantum is at least the core's)."""
    return v.runtime(now) >= resume_quantum(v, share)


class Candidate(NamedTuple):
    """What a gain search reads of one holder it may consider as a victim (a named
    tuple: one is built per holder per cycle, and a frozen dataclass costs several
    times as much to build)."""

    id: str
    #: expected remaining run time, and what evicting it now costs (seconds)
    left: float
    cost: float
    #: its GPUs x the work it would lose now, and the time to its next checkpoint
    #: (both 0.0 without a checkpoint interval)
    loss: float
    wait: float
    #: not protected, past its minimum runtime and progress
    evictable: bool
    #: the GPU (in thousandths) each of its replicas holds, and where
    held: tuple[tuple[str, int], ...]
    #: the holder itself (what :func:`joint_wake` reads of it at a later moment)
    v: Workload
    #: its expected wait to be placed again if evicted now (:func:`victim_rewait`)
    rewait: float = 0.0


class Holders:
    """The holders of one priority that gain searches examine at all (holding
    resources, running or starting, under the bound on preemptions, past the
    minimum quantum), with the GPU they hold per node: kept across cycles and
    brought up to date from the control plane's journal of changed workloads
    (:meth:`ControlPlane.changed_since`) and the clock, instead of read anew from
    every holder at every cycle. Those still under the minimum quantum wait,
    ordered by the moment they pass it.

    Everything it keeps about a holder moves only with a change the journal
    names (a transition, a placement, a priority, a preemption) or with the
    clock (the quantum), so it is what a reading of every holder at that moment
    would give (tests/core/test_journal_readers.py holds them equal)."""

    __slots__ = ("_ripening", "_young", "cp", "mark", "members", "node_gpu", "now", "on_node",
                 "place", "priority", "quantum_share", "rewaits", "spread")

    def __init__(
        self, cp: ControlPlane, priority: int, now: float, rewaits: Rewaits | None = None,
        quantum_share: float = 0.0,
    ) -> None:
        """``rewaits``: where the waits of evicted workloads placed again are learned
        (every holder it admits that was evicted before, of any priority, is
        shown to it; None: nothing is learned). ``quantum_share``: a holder whose
        run resumed from saved service passes its quantum only once that run
        lasts this share of it (:func:`resume_quantum`)."""
        self.cp = cp
        self.rewaits = rewaits
        self.quantum_share = quantum_share
        self.priority = priority
        self.now = now
        self.mark = cp.journal_mark()
        #: id -> (holder, (node, GPU in thousandths) per replica)
        self.members: dict[str, tuple[Workload, tuple[tuple[str, int], ...]]] = {}
        #: node -> the GPU its members hold there, and who they are (each once)
        self.node_gpu: dict[str, int] = {}
        self.on_node: dict[str, dict[str, None]] = {}
        #: member id -> its place in the control plane's holder order (a sort key)
        self.place: dict[str, tuple[int, int]] = {}
        #: how many members hold on more than one node (a gang spread out)
        self.spread = 0
        #: holders that pass but for the minimum quantum, and when each passes it
        #: (a heap with stale entries left in: each is checked when it comes up)
        self._young: dict[str, tuple[Workload, tuple[tuple[str, int], ...]]] = {}
        self._ripening: list[tuple[float, str, float]] = []
        workloads = cp.workloads
        for wid in cp.holder_ids():
            self._admit(workloads[wid], now)

    def refresh(self, cp: ControlPlane, now: float) -> bool:
        """Bring it up to ``now`` on ``cp``; False when it cannot be (another control
        plane, an earlier moment, or a journal that cannot tell what changed): a
        new one must be read."""
        if cp is not self.cp or now < self.now:
            return False
        changed = cp.changed_since(self.mark)
        if changed is None:
            return False
        self.mark = cp.journal_mark()
        self.now = now
        if changed:
            workloads = cp.workloads
            drop, admit = self._drop, self._admit
            for wid in dict.fromkeys(changed):
                drop(wid)
                v = workloads.get(wid)
                if v is not None and v.placement:
                    admit(v, now)
        heap = self._ripening
        if heap and heap[0][0] <= now + 1e-6:
            later = []
            while heap and heap[0][0] <= now + 1e-6:
                entry = heapq.heappop(heap)
                _, wid, started = entry
                got = self._young.get(wid)
                if got is None or got[0].started_at != started:
                    continue  # no longer young, or young again since (another entry)
                if now - started < resume_quantum(got[0], self.quantum_share):  # (as _admit)
                    later.append(entry)
                    continue
                del self._young[wid]
                self._add(wid, got)
            for entry in later:
                heapq.heappush(heap, entry)
        return True

    def _admit(self, v: Workload, now: float) -> None:
        if self.rewaits is not None and v.preemptions:
            self.rewaits.observe(v)
        p = v.priority_override
        started = v.started_at
        if (
            (v.spec.priority if p is None else p) != self.priority
            or v.state not in _EVICTABLE_STATES
            or v.preemptions >= GAIN_MAX_PREEMPTIONS
            or started is None
        ):
            return
        entry = (v, _held(v))
        quantum = resume_quantum(v, self.quantum_share)
        if now - started < quantum:
            self._young[v.id] = entry
            heapq.heappush(self._ripening, (started + quantum, v.id, started))
        else:
            self._add(v.id, entry)

    def _add(self, wid: str, entry: tuple[Workload, tuple[tuple[str, int], ...]]) -> None:
        self.members[wid] = entry
        self.place[wid] = self.cp.hold_key(entry[0])
        if _spread(entry[1]):
            self.spread += 1
        node_gpu, on_node = self.node_gpu, self.on_node
        for node, gpu in entry[1]:
            node_gpu[node] = node_gpu.get(node, 0) + gpu
            at = on_node.get(node)
            if at is None:
                on_node[node] = {wid: None}
            else:
                at[wid] = None

    def _drop(self, wid: str) -> None:
        entry = self.members.pop(wid, None)
        if entry is None:
            self._young.pop(wid, None)
            return
        del self.place[wid]
        if _spread(entry[1]):
            self.spread -= 1
        node_gpu, on_node = self.node_gpu, self.on_node
        for node, gpu in entry[1]:
            node_gpu[node] -= gpu
        for node, _ in entry[1]:
            at = on_node.get(node)
            if at is not None:
                at.pop(wid, None)  # (a gang with two replicas there: once)
                if not at:  # (its last member there)
                    del on_node[node], node_gpu[node]


def _spread(held: tuple[tuple[str, int], ...]) -> bool:
    """Whether a holder's replicas (``(node, GPU)`` each) are on more than one node."""
    return len(held) > 1 and any(node != held[0][0] for node, _ in held)


class GainPool:
    """What the gain searches of one cycle read of the holders of one priority that
    they examine at all (running or starting, past the minimum quantum, under the
    bound on preemptions: :class:`Holders`, kept across cycles): the part of a
    search that does not depend on the preemptor, so that a search that cannot
    find anything is known without scanning nodes (:func:`could_gain`).

    The pool knows, per node, the GPU its holders there hold, so a test for a
    replica asking ``need`` GPU reads only the holders on nodes where evicting
    every one of them could free enough (:meth:`viable`): a victim elsewhere
    frees nothing that helps. A holder's expected remaining time is computed the
    first time something reads it in the cycle, and the rest of its
    :class:`Candidate` (its cost, loss, wait, preemptibility and placement) the
    first time a test reaches it. :meth:`reaching` gives them longest first,
    down to a floor (a victim must be expected to run at least ``gain_ratio``
    times longer than its preemptor), for a reader that wants them in that order."""

    __slots__ = ("_cfg", "_full", "_holders", "_left", "_now", "_prior", "_reach",
                 "_remaining", "_rewaits", "_viable")

    def __init__(
        self,
        cfg: SchedulerConfig,
        remaining: Callable[[Workload, float], float | None],
        cp: ControlPlane,
        priority: int,
        now: float,
        holders: Holders | None = None,
    ) -> None:
        """``holders``: those of ``priority`` on ``cp`` as of ``now`` (read anew if not given)."""
        self._now = now
        self._remaining = remaining
        self._cfg = cfg
        self._prior = cfg.gain_prior_s
        share = cfg.gain_quantum_share
        if holders is None:
            holders = Holders(cp, priority, now, quantum_share=share)
        elif holders.quantum_share != share:
            raise ValueError(
                f"holders kept with quantum share {holders.quantum_share!r}, not the"
                f" configuration's {share!r}"
            )
        self._holders = holders
        #: where the victims' re-waits are read (None: they are not counted)
        self._rewaits = self._holders.rewaits if cfg.gain_rewait_quantile is not None else None
        #: expected remaining time per member, once read (NaN: an estimate that is
        #: not a number, which passes no victim test: not in the pool)
        self._left: dict[str, float] = {}
        self._full: dict[str, Candidate] = {}
        #: what :meth:`viable` answered, per question, with the fork and its count
        #: of changes it read (the members do not change within the cycle)
        self._viable: dict[
            tuple[int, frozenset[str], frozenset[str]], tuple[CapacityIndex, int, list[str]]
        ] = {}
        #: what :meth:`reach` last answered, and the list of :meth:`viable` it read
        self._reach: tuple[list[str], frozenset[str]] | None = None

    @property
    def spread(self) -> int:
        """How many of the holders it examines hold on more than one node."""
        return self._holders.spread

    @property
    def members(self) -> list[Workload]:
        """The holders it examines, in the control plane's holder order."""
        return [self._holders.members[wid][0] for wid in self._ordered()]

    def _ordered(self) -> list[str]:
        return sorted(self._holders.members, key=self._holders.place.__getitem__)

    def left_of(self, wid: str) -> float:
        """Member ``wid``'s expected remaining time (:func:`expected_left`; NaN: not a number)."""
        left = self._left.get(wid)
        if left is None:
            left = self._left[wid] = expected_left(
                self._remaining, self._holders.members[wid][0], self._now, self._prior
            )
        return left

    def candidate_of(self, wid: str, left: float) -> Candidate:
        """Member ``wid``'s candidate, expected to run ``left`` seconds more (:meth:`left_of`)."""
        c = self._full.get(wid)
        if c is None:
            v, held = self._holders.members[wid]
            c = self._full[wid] = self._candidate(left, v, held)
        return c

    def viable(
        self, need: int, nodes: frozenset[str], exclude: frozenset[str], fork: CapacityIndex
    ) -> list[str]:
        """The members (by id, in the holder order) on a ready node of ``nodes``
        outside ``exclude`` where the free GPU (on ``fork``) and that of every
        member there reach ``need``: nowhere else can victims make room for a
        replica asking ``need`` GPU, now or later. Kept while ``fork`` is unchanged
        (the tests of one cycle that places nothing ask it again and again; the
        node sets are frozen, so the question is its own key); the list is
        shared: a caller must not change it."""
        key = (need, nodes, exclude)
        got = self._viable.get(key)
        if got is not None and got[0] is fork and got[1] == fork.changes:
            return got[2]
        picked = self._viable_now(need, nodes, exclude, fork)
        self._viable[key] = (fork, fork.changes, picked)
        return picked

    def reach(
        self, need: int, nodes: frozenset[str], exclude: frozenset[str], fork: CapacityIndex
    ) -> frozenset[str]:
        """The nodes a victim search over ``nodes`` among these holders, for a
        replica asking ``need`` GPU, must read (a search given only the pool's
        members as equals): every node the members of :meth:`viable` hold on
        (where they could make room, and the other nodes of a gang spread out).
        Elsewhere no victim set frees enough, and every member there holds only
        on nodes that fall short: a search that skips the rest finds the same
        victims, and of the equals it would have read, leaves out only those
        that no later moment helps either (what :func:`joint_wake` passes over).
        The victim search's ``within`` (:meth:`CheapestVictims.select`);
        tests/sim/test_mlwe_policy.py checks every such search against the full
        one. Kept while :meth:`viable` answers with the same list."""
        picked = self.viable(need, nodes, exclude, fork)
        got = self._reach
        if got is not None and got[0] is picked:
            return got[1]
        members = self._holders.members
        out = frozenset(n for wid in picked for n, _ in members[wid][1])
        self._reach = (picked, out)
        return out

    def _viable_now(
        self, need: int, nodes: frozenset[str], exclude: frozenset[str], fork: CapacityIndex
    ) -> list[str]:
        status, free_gpu = fork.status, fork.free_gpu
        ready = NodeStatus.READY
        h = self._holders
        on_node = h.on_node
        picked: list[str] = []
        many = False
        for node, gpu in h.node_gpu.items():
            if (
                node in nodes
                and node not in exclude
                and free_gpu(node) + gpu >= need
                and status(node) is ready
            ):
                if picked:
                    many = True
                picked += on_node[node]
        if len(picked) > 1:
            # (a gang may hold on several of them: each member once)
            picked = sorted(set(picked) if many else picked, key=h.place.__getitem__)
        return picked

    def reaching(self, floor: float) -> Iterator[Candidate]:
        """The candidates expected to run at least ``floor`` seconds more, longest first."""
        left_of = self.left_of
        entries = [(x, wid) for wid in self._ordered() if (x := left_of(wid)) == x]
        # longest first; equal times keep the holders' order (the sort is stable)
        entries.sort(key=itemgetter(0), reverse=True)
        for left, wid in entries:
            if left < floor:
                return
            yield self.candidate_of(wid, left)

    def get(self, wid: str) -> Candidate | None:
        """Holder ``wid``'s candidate (None: the pool does not hold it: another
        priority, not running, under the minimum quantum, at the bound on
        preemptions, or an estimate that is not a number)."""
        if wid not in self._holders.members:
            return None
        left = self.left_of(wid)
        return self.candidate_of(wid, left) if left == left else None

    def all(self) -> list[Candidate]:
        """Every candidate, in the holders' order."""
        out = []
        for wid in self._ordered():
            left = self.left_of(wid)
            if left == left:
                out.append(self.candidate_of(wid, left))
        return out

    def _candidate(
        self, left: float, v: Workload, held: tuple[tuple[str, int], ...]
    ) -> Candidate:
        """The rest of ``v``'s candidate: inline, v.work_at_risk(now), cost_of(v, now),
        preemptible(v, now) and victim_rewait (tests/core/test_cycle_costs.py holds
        them equal)."""
        now = self._now
        spec = v.spec
        started = v.started_at
        assert started is not None
        iv = spec.checkpoint_interval
        risk, wait = exposure(v, now)
        since = risk if iv else 0.0
        return Candidate(
            v.id,
            left,
            risk + spec.restart_cost + spec.checkpoint_cost,
            max(v.gpus(), 1e-3) * since if iv else 0.0,
            wait,
            not (
                spec.protected
                or max(0.0, now - started) < spec.min_runtime
                or (spec.min_progress > 0 and v.progress < spec.min_progress)
            ),
            held,
            v,
            0.0 if self._rewaits is None else victim_rewait(self._cfg, self._rewaits, v, now),
        )


#: (placement, what gain tests read of it) per holder: a placement is immutable, so
#: its summary is kept while the workload holds the same one
_HELD: dict[str, tuple[tuple[ReplicaAlloc, ...], tuple[tuple[str, int], ...]]] = {}


def _held(v: Workload) -> tuple[tuple[str, int], ...]:
    """``(node, GPU in thousandths)`` per replica of ``v``'s placement."""
    got = _HELD.get(v.id)
    if got is None or got[0] is not v.placement:
        if len(_HELD) > 200_000:
            _HELD.clear()
        got = _HELD[v.id] = (v.placement, tuple((a.node, a.res.gpu) for a in v.placement))
    return got[1]


#: an equal a gain search passed over that may pass at a later moment: the holder,
#: its expected remaining time, seconds to its next checkpoint (0.0: it takes
#: none), where it holds what GPU, and its expected re-wait (:class:`Candidate`'s)
Later = tuple[Workload, float, float, tuple[tuple[str, int], ...], float]


def could_gain(
    cfg: SchedulerConfig,
    remaining: Callable[[Workload, float], float | None],
    w: Workload,
    shape: Shape,
    fork: CapacityIndex,
    nodes: frozenset[str],
    taken: Container[str],
    exclude: frozenset[str],
    pool: GainPool,
    now: float,
    drain: bool = False,
    cap: float = INF,
) -> tuple[bool, float]:
    """Whether a gain search for one replica of ``w`` over the candidate ``nodes``
    could find anything, and, if not, the earliest moment it would if only the
    clock moved (:func:`joint_wake`; INF: none).

    The test is the search's own, on what it would examine (candidates not yet
    taken, on a ready node of ``nodes`` outside ``exclude``): a victim must pass
    :func:`gain_choice`'s test for ``w``, and some node must then have the GPU the
    replica asks for (free on ``fork`` plus what the passing victims hold there).
    Only the candidates on nodes where that could ever be are read
    (:meth:`GainPool.viable`); what holders elsewhere would free never helps,
    and :func:`joint_wake` leaves their nodes out as well.
    False means the search finds nothing, and the wake time is the one it would
    report (both checked against the search in tests/sim/test_mlwe_policy.py).
    True is answered at the first node where passing victims free enough (the
    wake time is then INF: the search that follows reports its own).

    ``drain``: victims that would lose too much now count as well (a drain plan
    evicts them at their next checkpoint, see :func:`drain_choice`); the wake
    time is then not computed (INF). ``cap``: a wake time the caller already
    has; no moment from it on is looked for (one is returned as ``cap``)."""
    r_p = expected_left(remaining, w, now, cfg.gain_prior_s)
    floor = cfg.gain_ratio * r_p
    budget = cfg.gain_wait_share * max(w.gpus(), 1e-3)
    need = shape.gpu
    status, free_gpu = fork.status, fork.free_gpu
    ready = NodeStatus.READY
    freed: dict[str, int] = {}
    later: list[Later] = []
    left_of, candidate_of = pool.left_of, pool.candidate_of
    for wid in pool.viable(need, nodes, exclude, fork):
        if wid in taken:
            continue
        left = left_of(wid)
        if not left >= floor:  # below the floor no candidate passes the test (nor NaN)
            continue
        c = candidate_of(wid, left)
        # (outlasts: longer than the longer of r_p and its re-wait, plus its cost)
        if not left > r_p + c.cost or (c.rewait > r_p and not left > c.rewait + c.cost):
            if not drain and may_outlast(left, r_p, c.v, c.rewait):
                later.append((c.v, left, c.wait, c.held, c.rewait))  # passes once cheaper
            continue  # the test first: it turns most candidates away, and costs nothing
        if not drain and c.loss > budget * c.wait:  # loses too much now: wait for its checkpoint
            later.append((c.v, left, c.wait, c.held, c.rewait))
            continue
        if c.evictable:
            for node, gpu in c.held:
                if node in nodes and node not in exclude and status(node) is ready:
                    got = freed[node] = freed.get(node, 0) + gpu
                    if free_gpu(node) + got >= need:
                        return True, INF  # found (the wake time is read only on a miss)
        if not drain:
            later.append((c.v, left, c.wait, c.held, c.rewait))
    if drain or not later:
        return False, INF
    return False, joint_wake(
        later, r_p, cfg.gain_ratio, budget, need, fork, nodes, exclude, now, cap
    )


def may_outlast(left: float, r_p: float, v: Workload, rewait: float = 0.0) -> bool:
    """Whether holder ``v``, expected to run ``left`` seconds more (and to wait
    ``rewait`` to be placed again if evicted), may pass :func:`outlasts`'s cost
    bar against a preemptor expected to run ``r_p`` at some moment: just after a
    checkpoint its cost is only its restore and pause."""
    return left > (rewait if rewait > r_p else r_p) + v.spec.restart_cost + v.spec.checkpoint_cost


def holder_at(v: Workload, t: float, budget: float) -> tuple[float, bool, bool]:
    """What a gain test would read of holder ``v`` at a later moment ``t`` if only
    the clock moved: what evicting it then costs (seconds, as :func:`cost_of`),
    whether that loses little enough then (not :func:`loses_too_much` with
    ``budget``), and whether it may be a victim then (:func:`preemptible`).
    tests/core/test_cycle_costs.py holds it equal to those functions."""
    spec = v.spec
    started = v.started_at
    assert started is not None
    iv = spec.checkpoint_interval
    risk, wait = exposure(v, t)
    cheap = not iv or max(v.gpus(), 1e-3) * risk <= budget * wait
    ok = not (
        spec.protected
        or max(0.0, t - started) < spec.min_runtime
        or (spec.min_progress > 0 and v.progress < spec.min_progress)
    )
    return risk + spec.restart_cost + spec.checkpoint_cost, cheap, ok


def joint_wake(
    later: Sequence[Later],
    r_p: float,
    ratio: float,
    budget: float,
    need: int,
    fork: CapacityIndex,
    nodes: Container[str],
    exclude: Container[str],
    now: float,
    cap: float = INF,
) -> float:
    """The earliest moment after ``now`` at which a gain search that found nothing
    now would find victims for one replica asking ``need`` GPU (thousandths) if
    only the clock moved (INF: none).

    ``later``: the equals it may consider (holder, expected remaining time,
    seconds to its next checkpoint or 0.0 if it takes none, where it holds
    what GPU, and its expected wait to be placed again if evicted, as
    :class:`Candidate` has them), each expected to run ``ratio`` times longer
    than the preemptor (``r_p``) and longer than the longer of that and its
    re-wait (as of ``now``: its class of saved service moves only with its
    checkpoints), plus its restore and checkpoint pause. On a ready node of
    ``nodes`` outside ``exclude``, the free GPU plus that of the holders there
    that then pass the test (:func:`holder_at`: cheap enough to evict, costing
    little enough, evictable) must reach ``need``. A holder turns cheap only
    just after one of its checkpoints and stays so for a while, so only those
    moments (and those at which one passes its minimum runtime) are tried, up
    to one checkpoint period after the last of the latter: with one period on a
    node the pattern then repeats; with several, the node is looked at again
    after the longest (its moment is then a lower bound). No moment from ``cap`` on is
    looked for: the answer is then ``cap`` (a wake the caller already has), as
    it is when no holder on a node where all of them could free ``need``
    checkpoints before ``cap`` (holders on other nodes do not count: whatever
    they do, their nodes never fit the replica).

    A scheduler that woke at every victim's next checkpoint instead (the first
    moment one of them turns cheap) ran a cycle that found nothing at most of
    them: a waiting 8-GPU job needs every holder on a node cheap at once."""
    status, free_gpu = fork.status, fork.free_gpu
    ready = NodeStatus.READY
    per_node: dict[str, list[tuple[Workload, float, float, int, float]]] = {}
    for v, left, wait, held, rewait in later:
        # what it must outlast besides its cost: the preemptor, or its own re-wait
        bar = rewait if rewait > r_p else r_p
        for node, gpu in held:
            if node in nodes and node not in exclude and status(node) is ready:
                vs = per_node.get(node)
                if vs is None:
                    vs = per_node[node] = []
                vs.append((v, left, wait, gpu, bar))
    # only nodes where the free GPU and all of these holders' reach ``need`` can
    # ever do; no holder there turns cheap before the first of their next checkpoints
    viable: list[tuple[str, list[tuple[Workload, float, float, int, float]], int]] = []
    first = cap
    for vs_node, vs in per_node.items():
        free = free_gpu(vs_node)
        if free + sum(x[3] for x in vs) < need:
            continue
        viable.append((vs_node, vs, free))
        for _, _, wait, _, _ in vs:
            if wait > 0.0 and now + wait + 1e-6 < first:
                first = now + wait + 1e-6
    if first >= cap:
        return cap
    wake = cap
    for _, vs, free in viable:
        times: list[float] = []
        cycles: list[tuple[float, float]] = []  # (next checkpoint moment, period)
        until = now  # the last moment a holder there turns evictable (minimum runtime)
        for v, _, wait, _, _ in vs:
            spec = v.spec
            if wait > 0.0:
                cycles.append((now + wait, (spec.checkpoint_interval or 0.0) + spec.checkpoint_cost))
            started = v.started_at  # (0.0 is a start: a trace's first job starts then)
            ripe = (now if started is None else started) + spec.min_runtime + 1e-6
            if ripe > now and not spec.protected:
                times.append(ripe)
                until = max(until, ripe)
        if not cycles:
            continue  # no holder there turns cheaper with time
        periods = {period for _, period in cycles}
        horizon = until + max(periods)
        # each holder's checkpoints up to the horizon (with one period and nobody
        # ripening later, its next one: the pattern repeats after it)
        repeat = len(periods) > 1 or until > now
        for t, period in cycles:
            times.append(t + 1e-6)
            t += period
            while repeat and t <= horizon:
                times.append(t + 1e-6)
                t += period
        for t in sorted(times):
            if t >= wake:
                break
            got = free
            for v, left, _, g, bar in vs:
                cost, cheap, ok = holder_at(v, t, budget)
                if cheap and ok and left > bar + cost:
                    got += g
            if got >= need:
                wake = t
                break
        else:
            if len(periods) > 1 and horizon < wake:
                wake = horizon  # look again then
    return wake


def _wait_for_checkpoint(v: Workload, now: float) -> float:
    """Seconds until ``v``'s next periodic checkpoint is done (0.0: it takes none)."""
    nxt = v.next_checkpoint(now)
    return 0.0 if nxt is None else nxt - now


def takes_equals(policy: PreemptionPolicy) -> bool:
    """Whether ``policy.select`` takes an ``equals`` test (victims among equals),
    read from its signature. A TypeError raised inside a search is a bug to
    surface, never a sign that the policy does not take it."""
    select = getattr(policy, "select", None)
    return select is not None and _takes_equals(getattr(select, "__func__", select))


@lru_cache(maxsize=64)  # one entry per select function: its signature is read once
def _takes_equals(select: Callable[..., object]) -> bool:
    try:
        params = inspect.signature(select).parameters.values()
    except (TypeError, ValueError):  # no signature to read: assume the plain protocol
        return False
    return any(p.name == "equals" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def cost_of(v: Workload, now: float) -> float:
    """What evicting ``v`` now costs it, in seconds: the work since its last
    checkpoint, its restore and its checkpoint pause."""
    return v.work_at_risk(now) + v.spec.restart_cost + v.spec.checkpoint_cost


def _gang_penalty(v: Workload) -> float:
    """GPU-seconds charged for breaking ``v``'s gang by evicting it (0.0: no gang)."""
    return GANG_PENALTY_GPU_S if v.spec.replicas > 1 else 0.0


def outlasts(
    r_v: float, r_p: float, cost: float, ratio: float, rewait: float = 0.0
) -> bool:
    """The gain test on expected remaining times: a victim expected to run ``r_v``
    seconds more is worth evicting for a preemptor expected to run ``r_p`` when it
    runs ``ratio`` times longer, and longer than what it is delayed by plus what
    evicting it costs (``cost``, :func:`cost_of`). It is delayed by the preemptor's
    run, or by its own wait to be placed again (``rewait``: :func:`victim_rewait`)
    when that is longer: the preemptor then gains ``r_v`` and the victim loses
    the longer of the two. :func:`could_gain` spells it inline."""
    return r_v >= ratio * r_p and r_v > (rewait if rewait > r_p else r_p) + cost


def loses_too_much(v: Workload, now: float, budget: float) -> tuple[bool, float]:
    """Whether evicting ``v`` now loses too much against waiting for its next
    checkpoint, and that wait (seconds; 0.0 without a checkpoint interval).

    Too much: its GPUs x the work since its last checkpoint exceed ``budget`` (the
    preemptor's GPUs x ``gain_wait_share``) x the wait. Without a checkpoint
    interval nothing is saved by waiting, and it never does."""
    if not v.spec.checkpoint_interval:
        return False, 0.0
    wait = _wait_for_checkpoint(v, now)
    return max(v.gpus(), 1e-3) * v.work_at_risk(now) > budget * wait, wait


class GainAsk(NamedTuple):
    """What a gain search (:func:`gain_choice`, :func:`drain_choice`) is asked: the
    scheduler's configuration, estimator and victim policy, the cycle's control
    plane and capacity fork, and one replica of the waiting workload ``w``."""

    cfg: SchedulerConfig
    remaining: Callable[[Workload, float], float | None]
    preemption: PreemptionPolicy
    cp: ControlPlane
    fork: CapacityIndex
    w: Workload
    shape: Shape
    #: workloads already chosen as victims this cycle, and nodes the replica may not use
    taken: set[str]
    exclude: frozenset[str]
    now: float
    #: the cycle's gain pool for ``w``'s priority, when it has one: a search then
    #: reads each equal's estimate, cost and wait from it instead of anew
    pool: GainPool | None = None
    #: the waits of evicted workloads learned so far (None: none are counted)
    rewaits: Rewaits | None = None

    def expect(self, x: Workload) -> float:
        """``x``'s expected remaining run time (:func:`expected_left`)."""
        return expected_left(self.remaining, x, self.now, self.cfg.gain_prior_s)

    def rewait(self, v: Workload) -> float:
        """``v``'s expected wait to be placed again if evicted now (:func:`victim_rewait`)."""
        return victim_rewait(self.cfg, self.rewaits, v, self.now)

    def select(
        self, worth: Callable[[Workload], bool], within: frozenset[str] | None = None
    ) -> VictimChoice | None:
        """The victim policy's choice among the equals that pass ``worth``
        (``within``: the only nodes where some may, for a :class:`CheapestVictims`)."""
        select: Callable[..., VictimChoice | None] = self.preemption.select
        extra = {} if within is None else {"within": within}
        return select(
            self.cp, self.fork, self.w, self.shape, self.taken, self.exclude, equals=worth,
            **extra,
        )


def gain_choice(ask: GainAsk, cap: float = INF) -> tuple[GainChoice | None, float]:
    """Victims of ``ask.w``'s own priority worth evicting for it, or None.

    A victim qualifies when it is expected to run ``gain_ratio`` times longer
    than ``w`` and longer than ``w`` plus what evicting it costs (work since
    its last checkpoint, its restore, its checkpoint pause: :func:`outlasts`);
    the core adds the minimum quantum and the bound on preemptions. One that
    would lose too much now (:func:`loses_too_much`) is passed over until its
    next checkpoint. The set is taken only if the expected gain, in GPU-seconds
    (each victim's GPUs x the time by which ``w`` is shorter), exceeds the cost
    (each victim's GPUs x its cost, plus a gang penalty for each broken gang).

    Also returns, when it finds nothing worth it, the earliest moment it would if
    only the clock moved (:func:`joint_wake` on the equals it examined; INF: none,
    or a choice was found; ``cap``: as :func:`joint_wake`'s)."""
    ratio, now = ask.cfg.gain_ratio, ask.now
    expect = ask.expect
    r_p = expect(ask.w)
    budget = ask.cfg.gain_wait_share * max(ask.w.gpus(), 1e-3)
    # the equals it examined that may pass at a later moment (see joint_wake)
    later: dict[str, Later] = {}

    share = ask.cfg.gain_quantum_share

    def worth(v: Workload) -> bool:
        if not rested(v, now, share):
            return False  # (as the pool leaves it out)
        r_v = expect(v)
        rewait = ask.rewait(v)
        if r_v >= ratio * r_p and may_outlast(r_v, r_p, v, rewait):
            later[v.id] = (v, r_v, _wait_for_checkpoint(v, now), _held(v), rewait)
        if not outlasts(r_v, r_p, cost_of(v, now), ratio, rewait):
            return False
        # evict now, losing the work since its last checkpoint, or wait for its
        # next one (delaying the preemptor): now only if the loss is small
        # against the wait
        too_much, _ = loses_too_much(v, now, budget)
        return not too_much

    pool = ask.pool
    nodes: frozenset[str] | None = None  # the candidate nodes, once a set of them is made

    def worth_in_pool(v: Workload) -> bool:
        # worth(), on what the cycle's pool already computed of v (the same
        # functions, inlined: tests/core/test_cycle_costs.py holds them equal);
        # an equal the pool left out may not be preempted for gain at all
        assert pool is not None
        c = pool.get(v.id)
        if c is None:
            return False
        r_v = c.left
        if r_v >= ratio * r_p and may_outlast(r_v, r_p, v, c.rewait):
            later[v.id] = (v, r_v, c.wait, c.held, c.rewait)
        return outlasts(r_v, r_p, c.cost, ratio, c.rewait) and not c.loss > budget * c.wait

    def wake() -> float:
        if not later:
            return INF
        return joint_wake(
            list(later.values()), r_p, ratio, budget, ask.shape.gpu, ask.fork,
            frozenset(candidate_nodes(ask.fork, ask.shape)) if nodes is None else nodes,
            ask.exclude, now, cap,
        )

    if not takes_equals(ask.preemption):
        return None, INF  # a victim policy that knows no "equals"
    if pool is None:
        choice = ask.select(worth)
    else:
        # (a pool is made only for a CheapestVictims: Scheduler._gain_pool)
        nodes = frozenset(candidate_nodes(ask.fork, ask.shape))
        choice = ask.select(
            worth_in_pool, pool.reach(ask.shape.gpu, nodes, ask.exclude, ask.fork)
        )
    if choice is None:
        return None, wake()
    gain, cost, rewaited = _gain_and_cost(ask, choice, r_p, lambda v: cost_of(v, now))
    if gain <= cost:
        return None, wake()
    why = (
        f"preemption among equals: expected gain {gain / 3600:.2f} GPU-h > cost"
        f" {cost / 3600:.2f} GPU-h ({ask.w.id} expects {format_duration(r_p)} left{rewaited})"
    )
    return (choice, gain, cost, why), INF


def _gain_and_cost(
    ask: GainAsk, choice: VictimChoice, r_p: float, seconds: Callable[[Workload], float]
) -> tuple[float, float, str]:
    """The expected gain of evicting ``choice``'s victims for ``ask.w`` (each
    victim's GPUs x its expected remaining time less what it is delayed by: the
    preemptor's ``r_p``, or its own expected re-wait when longer), the cost (each
    victim's GPUs x ``seconds(victim)``, plus a gang penalty for each broken
    gang), both in GPU-seconds, and a note naming the victims whose re-wait
    counted (empty when none did)."""
    gain = cost = 0.0
    longer: list[str] = []
    for v, _ in choice.victims:
        g = max(v.gpus(), 1e-3)
        rewait = ask.rewait(v)
        if rewait > r_p:
            longer.append(f"{v.id} {format_duration(rewait)}")
        gain += g * (ask.expect(v) - (rewait if rewait > r_p else r_p))
        cost += g * seconds(v) + _gang_penalty(v)
    note = ""
    if longer:
        q = ask.cfg.gain_rewait_quantile
        note = (f"; expected re-wait of evicted equals (p{100 * (q or 0.0):.0f} of past"
                f" restarts with as much service) over it: {', '.join(longer)}")
    return gain, cost, note


class DrainPlan(NamedTuple):
    """Preemption among equals staged at the victims' checkpoints (a drain).

    A waiting workload fits on ``node`` once ``due``'s victims are gone, but some
    of them would lose too much work if evicted now, and their checkpoints are
    not aligned: a search that asks every victim to be cheap at the same moment
    rarely finds one. The plan evicts each victim at its own moment (now if it
    is cheap now, else just after its next checkpoint) and holds the node for
    the preemptor meanwhile: the GPUs a victim frees early stay idle until the
    last one leaves, and that idle time is part of the plan's cost."""

    node: str
    #: victim id -> when to evict it (simulated or engine seconds)
    due: dict[str, float]
    gain: float
    cost: float
    #: the victims' GPUs x the time they stay idle, held for the preemptor
    idle_gpu_s: float
    why: str
    choice: VictimChoice


def drain_choice(ask: GainAsk) -> DrainPlan | None:
    """A drain plan for one replica of ``ask.w``, or None.

    The victims pass :func:`gain_choice`'s test but for the work they would lose
    now (they are evicted at their checkpoints instead). The plan is taken only
    if the expected gain (as in :func:`gain_choice`) exceeds its cost: each
    victim's restore and checkpoint pause, the work lost by those evicted now,
    the GPU-seconds the held GPUs stay idle, and a gang penalty per broken gang.
    None as well when every victim is cheap now (the plain search takes those)."""
    w, now = ask.w, ask.now
    if w.spec.replicas != 1 or not takes_equals(ask.preemption):
        return None
    ratio = ask.cfg.gain_ratio
    expect = ask.expect
    r_p = expect(w)
    budget = ask.cfg.gain_wait_share * max(w.gpus(), 1e-3)

    share = ask.cfg.gain_quantum_share

    def worth(v: Workload) -> bool:
        return rested(v, now, share) and outlasts(
            expect(v), r_p, cost_of(v, now), ratio, ask.rewait(v)
        )

    choice = ask.select(worth)
    if choice is None or len({a.node for a in choice.allocs}) != 1:
        return None
    due: dict[str, float] = {}
    lost = 0.0
    for v, _ in choice.victims:
        too_much, wait = loses_too_much(v, now, budget)
        if too_much:
            due[v.id] = now + wait + 1e-6
        else:
            due[v.id] = now
            lost += max(v.gpus(), 1e-3) * v.work_at_risk(now)
    last = max(due.values())
    if last == now:
        return None
    gain, cost, rewaited = _gain_and_cost(
        ask, choice, r_p, lambda v: v.spec.restart_cost + v.spec.checkpoint_cost
    )
    idle = 0.0
    for v, _ in choice.victims:
        idle += max(v.gpus(), 1e-3) * (last - due[v.id])
    cost += lost + idle
    if gain <= cost:
        return None
    node = choice.allocs[0].node
    why = (
        f"preemption among equals: expected gain {gain / 3600:.2f} GPU-h > cost"
        f" {cost / 3600:.2f} GPU-h, drained on {node} at the victims' checkpoints (idle"
        f" while draining {idle / 3600:.2f} GPU-h; the last leaves in"
        f" {format_duration(last - now)}; {w.id} expects {format_duration(r_p)} left{rewaited})"
    )
    return DrainPlan(node, due, gain, cost, idle, why, choice)
