"""mlwe's default policy on real contended Philly jobs: honest knowledge and
worthwhile preemption.

The policy learns run times only from completed jobs. The proof: permute the
true durations of every job not finished by a moment t (and lengthen them so
none finishes before t either way); every decision made before t is the same,
byte for byte. A policy that peeked at a running or future job's duration
would decide differently.
"""

from __future__ import annotations

import dataclasses

import pytest

from mlwe.core.decisions import DecisionRecord
from mlwe.core.lifecycle import State
from mlwe.core.rules import GAIN_MAX_PREEMPTIONS
from mlwe.sim.replay import ReplayConfig, ReplayResult, replay
from mlwe.sim.traces import Trace, load_trace


@pytest.fixture(scope="module")
def contended() -> Trace:
    return load_trace("philly", limit=400, cluster="nodes:4x8")


def run(tr: Trace) -> ReplayResult:
    r = replay(tr, ReplayConfig(policy="mlwe", keep_decisions=10**7))
    assert r.metrics["rejected_batches"] == 0
    assert r.metrics["completed"] == len(tr.jobs)
    return r


def view(decisions: list[DecisionRecord], before: float) -> list[tuple[object, ...]]:
    return [(d.time, d.kind, d.workload, d.chosen, d.reasons, tuple(sorted(d.extra.items())))
            for d in decisions if d.time < before]


def test_permuting_unfinished_durations_changes_no_earlier_decision(contended: Trace) -> None:
    first = run(contended)
    done_at = {w.id: w.history[-1].time for w in first.cp.workloads.values()}
    t = sorted(done_at.values())[len(done_at) // 2]  # half the jobs are done by t
    unfinished = [j for j in contended.jobs if done_at[j.spec.id or j.job_id] > t]
    assert len(unfinished) > 50
    durations = [j.duration for j in unfinished]
    permuted = durations[1:] + durations[:1]
    assert permuted != durations
    changed = {j.job_id: d + t for j, d in zip(unfinished, permuted)}  # none ends before t
    jobs = tuple(
        dataclasses.replace(j, duration=changed[j.job_id]) if j.job_id in changed else j
        for j in contended.jobs
    )
    second = run(dataclasses.replace(contended, jobs=jobs))
    a, b = view(first.decisions, t), view(second.decisions, t)
    assert len(a) > 500
    assert a == b
    # and the run does differ afterwards: the check has teeth
    assert view(first.decisions, float("inf")) != view(second.decisions, float("inf"))


def test_preemption_among_equals_carries_gain_and_cost(contended: Trace) -> None:
    r = run(contended)
    gain = [d for d in r.decisions if d.kind == "preempt" and "gain_gpu_s" in d.extra]
    assert gain, "no preemption among equals on a contended trace"
    for d in gain:
        assert d.extra["gain_gpu_s"] > d.extra["cost_gpu_s"] >= 0
        assert d.reasons[0].startswith("preemption among equals: expected gain")
    for w in r.cp.workloads.values():
        assert w.state is State.SUCCEEDED
        assert w.preemptions <= GAIN_MAX_PREEMPTIONS
    m = r.metrics
    assert m["estimate_coverage"] > 0.5
    assert m["estimate_p50_rel_error"] is not None
    assert m["max_queue_delay_s"] is not None


def test_placements_say_which_estimate_ranked_them(contended: Trace) -> None:
    r = run(contended)
    ranked = [
        reason for d in r.decisions if d.kind == "place" for reason in d.reasons
        if reason.startswith("ranked by")
    ]
    assert ranked
    learned = [x for x in ranked if "past run" in x and "Gittins" in x]
    assert learned, ranked[:5]
    assert any("least attained service (no history)" in x for x in ranked)


def _scanning_at_most(monkeypatch: pytest.MonkeyPatch, max_scan: int | None) -> None:
    """Victim searches that examine at most ``max_scan`` nodes (None: as built)."""
    from mlwe.core.policies.preemption import CheapestVictims

    if max_scan is None:
        return
    built = CheapestVictims.__init__

    def init(self: CheapestVictims, *args: object, **kw: object) -> None:
        built(self, *args, **kw)  # type: ignore[arg-type]
        self.max_scan = max_scan

    monkeypatch.setattr(CheapestVictims, "__init__", init)


#: victim searches over every candidate node, and over a window of 3 of the
#: contended cluster's 4 nodes (as a cluster larger than ``max_scan`` has them)
SCANS = pytest.mark.parametrize("max_scan", [None, 3], ids=["every-node", "window"])


@SCANS
def test_a_skipped_gain_search_would_have_found_nothing(
    contended: Trace, monkeypatch: pytest.MonkeyPatch, max_scan: int | None
) -> None:
    """The scheduler skips a gain search it knows finds nothing (could_gain on
    the holders reduced once per cycle, or an earlier search of the cycle for the
    same shape by a preemptor expected to end no later). Every skip is checked against the full
    search run in its place: it finds no victim set either, and leaves the same
    wake time and the same rotating start (so decisions are unchanged). Also
    when a search examines only a window of the nodes from its rotating start."""
    from mlwe.core import scheduler as sched
    from mlwe.core.cycle import Cycle, Turn
    from mlwe.core.gain import expected_left, gain_choice
    from mlwe.core.policies.preemption import CheapestVictims, candidate_nodes

    _scanning_at_most(monkeypatch, max_scan)
    skipped: list[str] = []
    searched: list[str] = []
    original = sched.Scheduler._could_gain

    def checked(self: sched.Scheduler, cycle: Cycle, turn: Turn) -> bool:
        policy = self.preemption
        assert isinstance(policy, CheapestVictims)
        cursor, wake_before = policy._cursor, self._wake_at
        w = turn.w
        nodes = candidate_nodes(cycle.fork, turn.shape)
        start = policy.window(nodes)[0] if len(nodes) > policy.max_scan else None
        miss = cycle.gain_misses.get(
            (w.priority, turn.shape, w.spec.replicas, turn.exclude, len(cycle.taken), start)
        )
        known = miss is not None and miss.r_p <= expected_left(
            self.remaining, w, cycle.now, self.config.gain_prior_s
        )
        possible = original(self, cycle, turn)
        assert not (known and possible)
        if possible:
            searched.append(turn.w.id)
            return True
        skip_cursor, skip_wake = policy._cursor, self._wake_at
        policy._cursor = cursor
        got, wake = gain_choice(self._gain_ask(cycle, turn))
        assert got is None, f"skipped a gain search for {turn.w.id} that finds {got}"
        assert policy._cursor == skip_cursor
        assert min(wake_before, wake) == skip_wake
        skipped.append(turn.w.id)
        if known:
            known_misses.append(turn.w.id)
        if turn.w.spec.replicas > 1:
            gangs.append(turn.w.id)
        return False

    gangs: list[str] = []
    known_misses: list[str] = []
    monkeypatch.setattr(sched.Scheduler, "_could_gain", checked)
    run(contended)
    assert len(skipped) > 100 and searched  # both paths were taken
    if max_scan is None:
        assert gangs  # gangs (several replicas, no per-node cap) are skipped too
        assert known_misses  # and searches known from an earlier miss of the cycle
    else:
        assert not gangs  # a gang's replicas would scan one window after another


@SCANS
def test_a_reservation_left_unprojected_would_have_let_no_search_find_victims(
    contended: Trace, monkeypatch: pytest.MonkeyPatch, max_scan: int | None
) -> None:
    """The blocked head's reservation is projected before a later workload may
    preempt (it closes nodes to it), unless no search could find victims even
    with every node open. Every such skip is checked: projecting the reservation
    and running the gain test with its nodes closed finds nothing either."""
    from mlwe.core import scheduler as sched
    from mlwe.core.cycle import Cycle, Turn
    from mlwe.core.gain import could_gain
    from mlwe.core.policies.preemption import CheapestVictims

    _scanning_at_most(monkeypatch, max_scan)
    skipped: list[str] = []
    projected: list[str] = []
    exhausted: list[str] = []
    original = sched.Scheduler._could_preempt

    def checked(self: sched.Scheduler, cycle: Cycle, turn: Turn) -> bool | None:
        assert not cycle.projected and cycle.head is not None
        policy = self.preemption
        assert isinstance(policy, CheapestVictims)
        before = policy._cursor  # (a window of the nodes starts there)
        got = original(self, cycle, turn)
        if got is None:
            projected.append(turn.w.id)
            return got
        cursor, wake, cache = policy._cursor, self._wake_at, self._reservation_cache
        res = self._reserve(cycle.cp, cycle.head, cycle.fork, cycle.now, cycle.dirty)
        self._reservation_cache = cache
        exclude: frozenset[str] = frozenset()
        if res is not None and not self._ends_before(turn.w, cycle.now, res.start):
            exclude = res.nodes
        policy._cursor = before  # the nodes the skipped search would have examined
        pool = self._gain_pool(cycle, turn)
        policy._cursor = cursor
        if cycle.gain_searches >= self.config.max_gain_searches:
            exhausted.append(turn.w.id)  # no gain search is left for it: none runs
        elif isinstance(pool, bool):
            assert pool is False
        else:
            possible, _ = could_gain(
                self.config, self.remaining, turn.w, turn.shape, cycle.fork, pool[1],
                cycle.taken, exclude, pool[0], cycle.now,
            )
            assert not possible, f"{turn.w.id} could gain with the reservation in force"
        assert (policy._cursor, self._wake_at) == (cursor, wake)  # the check moved nothing
        skipped.append(turn.w.id)
        return got

    monkeypatch.setattr(sched.Scheduler, "_could_preempt", checked)
    run(contended)
    assert len(skipped) > 100 and projected  # both paths were taken
    assert len(exhausted) < len(skipped)  # and most skips were answered by the gain test


@SCANS
def test_a_gain_search_within_the_pools_reach_finds_what_a_full_search_finds(
    contended: Trace, monkeypatch: pytest.MonkeyPatch, max_scan: int | None
) -> None:
    """A gain search with the cycle's pool reads the holders of only the nodes in
    the pool's reach (GainPool.reach): elsewhere no set of its equals frees
    enough. Every such search is checked against the same search reading every
    node it examines: the same choice (victims, places, cost, alternatives,
    nodes examined), the same wake time (as the scheduler keeps it: the lesser of
    the one it has and the search's) and the same rotating start after it,
    so the decisions are unchanged. Also on a window of the nodes."""
    from mlwe.core import scheduler as sched
    from mlwe.core.gain import GainAsk, GainPool, gain_choice
    from mlwe.core.policies.preemption import CheapestVictims, candidate_nodes

    _scanning_at_most(monkeypatch, max_scan)
    narrowed: list[int] = []  # nodes left out of each search's reach
    reach = GainPool.reach

    def checked(ask: GainAsk, cap: float = float("inf")) -> tuple[object, float]:
        policy = ask.preemption
        assert isinstance(policy, CheapestVictims)
        before = policy._cursor
        if ask.pool is None:
            return gain_choice(ask, cap)
        got, wake = gain_choice(ask, cap)
        after = policy._cursor
        nodes = frozenset(candidate_nodes(ask.fork, ask.shape))
        within = reach(ask.pool, ask.shape.gpu, nodes, ask.exclude, ask.fork)
        narrowed.append(len(nodes - within))
        policy._cursor = before
        with pytest.MonkeyPatch.context() as m:
            m.setattr(GainPool, "reach", lambda *a: None)  # every examined node read
            full, full_wake = gain_choice(ask, cap)
        assert policy._cursor == after
        # (a search that read no equal that may pass later answers INF, one that read
        # some on nodes that never fit answers the cap: the scheduler keeps the lesser)
        assert (min(cap, wake), got) == (min(cap, full_wake), full), ask.w.id
        return got, wake

    monkeypatch.setattr(sched, "gain_choice", checked)
    run(contended)
    assert len(narrowed) > 20 and sum(1 for n in narrowed if n) > 10
