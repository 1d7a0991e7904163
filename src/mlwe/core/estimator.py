"""Runtime estimates learned online from completed workloads, honestly.

The estimator sees a workload's spec (what a real scheduler has: queue, owner
label, kind, name stem, GPU count, requested resources, the user's own
estimate, iterations where the spec's labels give them) and, for work that has
run, the service it has attained. It learns only when a workload SUCCEEDS,
from what the control plane itself measured (the seconds of work of the run),
never from running or future work: in a replay it learns as the trace unfolds,
and in the engine it is seeded from the control plane's completed workloads
(what the store recovered), so it survives restarts.

Model: one bounded sample of past run times per feature key, from specific to
general (queue + name stem + GPUs ... down to everything). Each key keeps the
record of its own predictions: when a run completes, before it is learned,
every key it belongs to that already had ``min_samples`` runs is scored on it
(the relative error of that key's median). A prediction from run times uses,
among the keys with at least ``min_samples`` runs, the one whose own
predictions have the lowest median error once ``min_errors`` are scored
(3Sigma's choice of feature by past accuracy, Park et al., EuroSys 2018); while
none has such a record, the most specific one. Where the labels give an
iteration count, the most specific key's seconds per iteration are used; where
the user gave an estimate, its ratio actual / estimate (scored the same way,
but chosen by specificity: choosing those by record too lost on ITP, see
``_best``). For attained service ``a``
the distribution is conditioned on S > a: the expected remaining time is the
median of what is left, and the Gittins index (the best ratio of completion
probability to expected service over every quantum) ranks size-aware
orderings.

Pure and deterministic: no I/O, no clock (times come from the caller).
"""

from __future__ import annotations

import bisect
import math
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from mlwe.core.lifecycle import State, Transition
from mlwe.core.model import Workload
from mlwe.core.resources import format_duration
from mlwe.core.spec import WorkloadSpec

if TYPE_CHECKING:
    from mlwe.core.controlplane import ControlPlane

_DIGITS = re.compile(r"[0-9a-f]{6,}|\d+", re.IGNORECASE)
_ITER_LABELS = ("num_iteration", "iterations", "num_iterations")
_OWNER_LABELS = ("owner", "user")


def name_stem(name: str) -> str:
    """The name without its numbers and hex ids ("train-bert-0042" -> "train-bert-#")."""
    return _DIGITS.sub("#", name)[:80]


def _iterations(spec: WorkloadSpec) -> float | None:
    for k in _ITER_LABELS:
        v = spec.labels.get(k)
        if v:
            try:
                x = float(v)
            except ValueError:
                return None
            return x if math.isfinite(x) and x > 0 else None
    return None


@dataclass(slots=True)
class _Sample:
    """The last ``keep`` values seen under one key, sorted, with running errors."""

    keep: int
    version: int = 0
    order: deque[float] = field(default_factory=deque)
    sorted: list[float] = field(default_factory=list)
    #: sorted relative errors of this key's own past predictions (its median,
    #: scored on each run it saw complete before learning it)
    errors: list[float] = field(default_factory=list)

    def add(self, x: float) -> None:
        self.version += 1
        self.order.append(x)
        bisect.insort(self.sorted, x)
        if len(self.order) > self.keep:
            old = self.order.popleft()
            del self.sorted[bisect.bisect_left(self.sorted, old)]

    def note_error(self, e: float) -> None:
        bisect.insort(self.errors, e)
        if len(self.errors) > self.keep:
            # keep the middle: drop alternately from each end (a running median's view)
            self.errors.pop(0 if len(self.errors) % 2 else -1)

    def median(self) -> float:
        s = self.sorted
        return s[len(s) // 2]


class _Choice:
    """What :meth:`RuntimeEstimator._best` chose for one key list in one table, as
    of an epoch, and the first epoch since which it has been the same (a
    prediction made in an epoch from ``since`` on read what it would read now)."""

    __slots__ = ("by_record", "epoch", "got", "keys", "since", "table")

    def __init__(
        self, table: dict[tuple[str, ...], _Sample], keys: list[tuple[tuple[str, ...], str]],
        by_record: bool,
    ) -> None:
        self.table, self.keys, self.by_record = table, keys, by_record
        self.epoch = self.since = -1
        self.got: tuple[_Sample, str] | None = None


@dataclass(frozen=True, slots=True)
class Estimate:
    """A predicted run time and where it came from."""

    total_s: float  # expected total seconds of work
    remaining_s: float  # expected seconds left given the service attained
    samples: int  # past runs it is based on (0: the user's estimate alone)
    basis: str  # e.g. "queue nlp with 8 GPUs"
    source: str  # "history", "iterations", "user-calibrated" or "user"
    p50_error: float | None  # median relative error of this key's past predictions

    def describe(self) -> str:
        """'2h10m from 37 past runs in queue nlp with 8 GPUs, p50 error 18%'."""
        text = f"{format_duration(self.total_s)}"
        if self.source == "user":
            return text + " (the user's estimate; no history to check it against)"
        text += f" from {self.samples} past run{'s' if self.samples != 1 else ''} {self.basis}"
        if self.p50_error is not None:
            text += f", p50 error {100 * self.p50_error:.0f}%"
        return text


class RuntimeEstimator:
    """Online run-time estimates from completed workloads (see the module docstring)."""

    name = "learned-runtime"

    def __init__(self, min_samples: int = 3, keep: int = 256, min_errors: int = 3) -> None:
        if min_samples < 1 or keep < min_samples or not 1 <= min_errors <= keep:
            raise ValueError("need 1 <= min_samples <= keep and 1 <= min_errors <= keep")
        self.min_samples = min_samples
        self.keep = keep
        #: scored predictions a run-time key needs before its record may choose it
        self.min_errors = min_errors
        self._durations: dict[tuple[str, ...], _Sample] = {}
        self._per_iter: dict[tuple[str, ...], _Sample] = {}
        self._ratio: dict[tuple[str, ...], _Sample] = {}
        self.learned = 0
        #: relative error |predicted - actual| / actual of the prediction made at
        #: submission, for every completed workload that had one
        self.errors: list[float] = []
        self.predicted = 0  # completed workloads that had a prediction at submission
        self.completed = 0
        self._at_submit: dict[str, float | None] = {}
        #: id -> (epoch, attained, estimate, spec)
        self._cache: dict[str, tuple[int, float, Estimate | None, WorkloadSpec]] = {}
        #: bumped by every learn(), the only thing that changes a sample (its
        #: values, or its record of errors, which may change which key a
        #: prediction uses): a prediction kept from the same epoch, for the same
        #: spec, is exactly what a new one would be
        self._epoch = 0
        #: id -> (epoch, sample read or None, spec, total, choice): the total is
        #: fixed, or -1 (read the sample at the attained service), or None (no
        #: estimate); the choice that decided it, where only the history of run
        #: times decides (it tells when the basis changes), else None
        self._basis: dict[
            str, tuple[int, _Sample | None, WorkloadSpec, float | None, _Choice | None]
        ] = {}
        self._keys_of: dict[
            str, tuple[WorkloadSpec, list[tuple[tuple[str, ...], str]], float | None]
        ] = {}
        #: one list per distinct set of keys (equal lists are the same object), so
        #: that what :meth:`_best` chose for it can be kept per epoch
        self._key_lists: dict[tuple[tuple[str, ...], ...], list[tuple[tuple[str, ...], str]]] = {}
        #: (table, id of a key list) -> what _best chose for it, as of an epoch: a
        #: choice changes only when the epoch moves (every learn())
        self._chosen: dict[tuple[int, int], _Choice] = {}
        self._gittins: dict[tuple[int, float], tuple[int, float]] = {}
        self._attached: object | None = None

    def fresh(self, learned_then: int) -> bool:
        """Whether a prediction made when ``learned_then`` runs were known still
        stands: until the history grows by 5% (at least 8 runs), a cached
        prediction is reused (bounded staleness keeps a cycle over a long queue
        cheap; the choice depends only on counts, so it stays deterministic)."""
        return self.learned - learned_then <= max(8, learned_then // 20)

    def keys_for(self, w: Workload) -> list[tuple[tuple[str, ...], str]]:
        return self._features(w)[1]

    def _features(
        self, w: Workload
    ) -> tuple[WorkloadSpec, list[tuple[tuple[str, ...], str]], float | None]:
        """``w``'s spec, its feature keys and its iterations, kept per workload
        while its spec is the same object."""
        got = self._keys_of.get(w.id)
        if got is None or got[0] is not w.spec:
            if len(self._keys_of) > 200_000:
                self._keys_of.clear()
            keys = self._keys(w.spec)
            sig = tuple(k for k, _ in keys)
            interned = self._key_lists.get(sig)
            if interned is None:
                if len(self._key_lists) > 200_000:
                    self._key_lists.clear()
                interned = self._key_lists[sig] = keys
            got = self._keys_of[w.id] = (w.spec, interned, _iterations(w.spec))
        return got

    # ------------------------------------------------------------------ features
    @staticmethod
    def _keys(spec: WorkloadSpec) -> list[tuple[tuple[str, ...], str]]:
        """Feature keys from most specific to least, each with words for reports."""
        q = spec.queue
        stem = name_stem(spec.name)
        g = f"{spec.resources.gpu * spec.replicas / 1000:g}"
        owner = next((spec.labels[k] for k in _OWNER_LABELS if spec.labels.get(k)), "")
        model = spec.labels.get("model_name", "")
        batch = spec.labels.get("batch_size", "")
        keys: list[tuple[tuple[str, ...], str]] = []
        if model:
            keys.append((("m", model, batch, g), f"of {model} (batch {batch or '?'}) with {g} GPUs"))
            keys.append((("m", model, g), f"of {model} with {g} GPUs"))
        if owner:
            keys.append((("o", q, owner, stem, g), f"by {owner} in queue {q} like {stem}"))
        keys += [
            (("q", q, stem, g), f"in queue {q} like {stem} with {g} GPUs"),
            (("q", q, spec.kind.value, g), f"in queue {q} of kind {spec.kind.value} with {g} GPUs"),
            (("s", stem, g), f"like {stem} with {g} GPUs"),
            (("q", q, spec.kind.value), f"in queue {q} of kind {spec.kind.value}"),
            (("g", g), f"with {g} GPUs"),
            (("*",), "of any kind"),
        ]
        return keys

    # ------------------------------------------------------------------ learning
    def learn(self, spec: WorkloadSpec, run_s: float) -> None:
        """A workload with ``spec`` completed after ``run_s`` seconds of work."""
        if not (math.isfinite(run_s) and run_s >= 0):
            return
        run_s = max(run_s, 1e-3)
        self.learned += 1
        keys = self._keys(spec)
        self._add(self._durations, keys, run_s)
        it = _iterations(spec)
        if it:
            self._add(self._per_iter, keys, run_s / it)
        if spec.estimated_duration:
            self._add(self._ratio, keys, run_s / spec.estimated_duration)
        self._epoch += 1  # a record moved, or a sample became usable: the choice may change

    def _add(
        self, table: dict[tuple[str, ...], _Sample], keys: list[tuple[tuple[str, ...], str]],
        x: float,
    ) -> None:
        for k, _ in keys:
            s = self._sample(table, k)
            if len(s.order) >= self.min_samples:
                s.note_error(abs(s.median() - x) / x)  # its own prediction, scored first
            s.add(x)

    def _sample(self, table: dict[tuple[str, ...], _Sample], key: tuple[str, ...]) -> _Sample:
        s = table.get(key)
        if s is None:
            s = table[key] = _Sample(self.keep)
        return s

    def _best(
        self, table: dict[tuple[str, ...], _Sample], keys: list[tuple[tuple[str, ...], str]],
        by_record: bool = False,
    ) -> tuple[_Sample, str] | None:
        """The sample a prediction reads (with its words). Run times: among
        ``keys`` with at least ``min_samples`` runs, the one whose own predictions
        have the lowest median error (``min_errors`` scored; the more specific on
        a tie); while none has such a record, the most specific one (``by_record``).
        Seconds per iteration and the ratio to the user's estimate: the most
        specific (by record, ITP's avg JCT rose 13% on itp:02, where iterations drive the
        estimates: benchmarks/policy_quality.py)."""
        return self._choice(table, keys, by_record).got

    def _choice(
        self, table: dict[tuple[str, ...], _Sample], keys: list[tuple[tuple[str, ...], str]],
        by_record: bool = False,
    ) -> _Choice:
        """:meth:`_best`'s choice for ``keys`` in ``table``, as of this epoch."""
        memo = (id(table), id(keys))
        kept = self._chosen.get(memo)
        if kept is None or kept.keys is not keys:
            if len(self._chosen) > 200_000:
                self._chosen.clear()
            # (the entry holds the list, so its id is not reused while the entry stands)
            kept = self._chosen[memo] = _Choice(table, keys, by_record)
        if kept.epoch != self._epoch:
            self._recheck(kept)
        return kept

    def _recheck(self, c: _Choice) -> None:
        """Bring choice ``c`` to this epoch; its ``since`` moves only if it changed."""
        got = self._choose(c.table, c.keys, c.by_record)
        old = c.got
        # (each key of a list has its own words: the same words, the same sample)
        if c.epoch < 0 or (None if got is None else got[1]) != (None if old is None else old[1]):
            c.since = self._epoch
        c.got, c.epoch = got, self._epoch

    def _choose(
        self, table: dict[tuple[str, ...], _Sample], keys: list[tuple[tuple[str, ...], str]],
        by_record: bool,
    ) -> tuple[_Sample, str] | None:
        need = self.min_samples
        if not by_record:
            for k, words in keys:
                s = table.get(k)
                if s is not None and len(s.order) >= need:
                    return s, words
            return None
        first: tuple[_Sample, str] | None = None
        best: tuple[_Sample, str] | None = None
        best_err = math.inf
        scored = self.min_errors
        for k, words in keys:
            s = table.get(k)
            if s is None or len(s.order) < need:
                continue
            if first is None:
                first = (s, words)
            errs = s.errors
            if len(errs) >= scored:
                e = _median(errs)
                if e is not None and e < best_err:
                    best, best_err = (s, words), e
        return best if best is not None else first

    # ---------------------------------------------------------------- prediction
    def estimate(self, w: Workload, attained_s: float = 0.0) -> Estimate | None:
        """Expected run time of ``w`` given ``attained_s`` seconds of work done; None
        when neither history nor the user gives anything.

        A prediction is kept per workload and reused while it is exactly what a
        new one would be: same spec and attained service, and nothing learned
        since (the epoch)."""
        cached = self._cache.get(w.id)
        if (
            cached is not None
            and cached[0] == self._epoch
            and cached[1] == attained_s
            and cached[3] is w.spec
        ):
            return cached[2]
        est = self._predict(w.spec, attained_s, self.keys_for(w))[0]
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[w.id] = (self._epoch, attained_s, est, w.spec)
        return est

    def remaining_s(self, w: Workload, attained_s: float = 0.0) -> float | None:
        """``estimate(w, attained_s).remaining_s`` (None: no estimate), without
        building the estimate: what a scheduling cycle asks of every running
        workload, whose attained service moves at every cycle. The basis (which
        sample, or a fixed total) is kept per workload while it is exactly what
        a new prediction would read (see :meth:`estimate`)."""
        epoch = self._epoch
        got = self._basis.get(w.id)
        if got is not None and got[0] != epoch:
            # learned since: a history's basis still stands while its key list's
            # choice is the one it read (the sample is read anew below); a fixed
            # total (iterations, the user's) is read again
            c = got[4]
            if c is None:
                got = None
            else:
                if c.epoch != epoch:
                    self._recheck(c)
                if c.since > got[0]:
                    got = None
        if got is None or got[2] is not w.spec:
            _, keys, it = self._features(w)
            total, used, c = self._basis_of(w.spec, keys, it)
            if len(self._basis) > 100_000:
                self._basis.clear()
            got = self._basis[w.id] = (epoch, used, w.spec, total, c)
        total = got[3]
        if total is None:
            return None
        if total < 0:
            sample = got[1]
            assert sample is not None
            xs = sample.sorted
            i = bisect.bisect_right(xs, attained_s)
            left = len(xs) - i
            total = xs[i + left // 2] if left else 2.0 * attained_s
        rest = total - attained_s
        return rest if rest > 0.0 else 0.0  # max(0.0, rest), without the call

    def _basis_of(
        self, spec: WorkloadSpec, keys: list[tuple[tuple[str, ...], str]], it: float | None
    ) -> tuple[float | None, _Sample | None, _Choice | None]:
        """What :meth:`_predict` would base its total on, without building the
        estimate: the total (None: no estimate; -1.0: the history's, which depends
        on the attained service), the sample read (None: none), and, where only
        the history of run times decides (no iterations, no user's estimate),
        the choice that decided, which tells when the basis changes. The same
        rules in the same order as :meth:`_predict` (``it``: the spec's iterations)."""
        if it:
            got = self._best(self._per_iter, keys)
            if got is not None:
                return it * got[0].median(), got[0], None
        user = spec.estimated_duration
        if user:
            got = self._best(self._ratio, keys)
            if got is not None:
                return user * got[0].median(), got[0], None
            return user, None, None
        c = self._choice(self._durations, keys, True)
        if c.got is None:
            return None, None, None if it else c
        return -1.0, c.got[0], None if it else c

    def _estimate(
        self, spec: WorkloadSpec, a: float, keys: list[tuple[tuple[str, ...], str]] | None = None
    ) -> Estimate | None:
        return self._predict(spec, a, keys if keys is not None else self._keys(spec))[0]

    def _predict(
        self, spec: WorkloadSpec, a: float, keys: list[tuple[tuple[str, ...], str]]
    ) -> tuple[Estimate | None, _Sample | None]:
        """The prediction, and the sample it read (None: it read none)."""
        it = _iterations(spec)
        if it:
            got = self._best(self._per_iter, keys)
            if got is not None:
                s, words = got
                total = it * s.median()
                return Estimate(total, max(0.0, total - a), len(s.order), words, "iterations",
                                _median(s.errors)), s
        user = spec.estimated_duration
        if user:
            got = self._best(self._ratio, keys)
            if got is not None:
                s, words = got
                total = user * s.median()
                return Estimate(total, max(0.0, total - a), len(s.order), words,
                                "user-calibrated", _median(s.errors)), s
            return Estimate(user, max(0.0, user - a), 0, "", "user", None), None
        got = self._best(self._durations, keys, by_record=True)
        if got is None:
            return None, None
        s, words = got
        xs = s.sorted
        i = bisect.bisect_right(xs, a)
        left = len(xs) - i
        # the median of what is left; a job that has outlived every past run is
        # expected to run as long again (a heavy tail's rule of thumb) rather
        # than to end now
        total = xs[i + left // 2] if left else 2.0 * a
        return Estimate(total, max(0.0, total - a), len(s.order), words, "history",
                        _median(s.errors)), s

    def gittins_index(self, w: Workload, attained_s: float) -> float | None:
        """Gittins index (1/s) of ``w`` at attained service ``attained_s`` over the
        learned distribution of its key: max over quanta D of P(S - a <= D | S > a)
        / E[min(S - a, D) | S > a]. None without enough history."""
        got = self._best(self._durations, self.keys_for(w), by_record=True)
        if got is None:
            return None
        sample = got[0]
        ck = (id(sample), attained_s)
        hit = self._gittins.get(ck)
        if hit is not None and hit[0] == sample.version:
            return hit[1]
        g = self._gittins_of(sample.sorted, attained_s)
        if len(self._gittins) > 200_000:
            self._gittins.clear()
        self._gittins[ck] = (sample.version, g)
        return g

    @staticmethod
    def _gittins_of(s: list[float], a: float) -> float:
        tail = s[bisect.bisect_right(s, a):]
        m = len(tail)
        if m == 0:
            return 1.0 / max(1.0, a)  # outlived the history: LAS-like, lower as it runs
        best = 0.0
        acc = 0.0
        for k, x in enumerate(tail, start=1):
            d = x - a
            acc += d
            denom = acc + (m - k) * d
            if denom > 0:
                best = max(best, k / denom)
        return best if best > 0 else 1.0

    # --------------------------------------------------------------- bookkeeping
    def note_submitted(self, w: Workload) -> None:
        """Remember the prediction made when ``w`` arrived (for the error figures)."""
        if w.id not in self._at_submit:
            # (through the kept predictions: at a first placement the order has
            # usually just asked the same of the same epoch)
            e = self.estimate(w, 0.0)
            self._at_submit[w.id] = None if e is None or e.source == "user" else e.total_s

    def note_completed(self, w: Workload, run_s: float) -> None:
        """``w`` succeeded after ``run_s`` seconds of work: score, then learn."""
        self.completed += 1
        pred = self._at_submit.pop(w.id, None)
        if pred is not None and run_s > 0:
            err = abs(pred - run_s) / run_s
            self.predicted += 1
            self.errors.append(err)
        self.learn(w.spec, run_s)

    def error_stats(self) -> dict[str, float | int | None]:
        """Median and p90 relative error of the prediction made at submission (or,
        where none could be made then, at first placement), and coverage (share of
        completed workloads that had a learned prediction)."""
        errs = sorted(self.errors)
        return {
            "estimate_p50_rel_error": _r(_pick(errs, 0.5)),
            "estimate_p90_rel_error": _r(_pick(errs, 0.9)),
            "estimate_coverage": _r(self.predicted / self.completed) if self.completed else None,
            "estimate_scored": self.predicted,
        }

    # --------------------------------------------------------------- attachment
    def attach(self, cp: ControlPlane) -> None:
        """Learn from ``cp``: its completed workloads now (a recovered store's
        history), and every workload that succeeds from now on. Idempotent."""
        if self._attached is cp:
            return
        self._attached = cp
        done = [w for w in cp.workloads.values() if w.state is State.SUCCEEDED]
        done.sort(key=lambda w: (w.history[-1].time if w.history else 0.0, w.seq))
        for w in done:
            self.learn(w.spec, run_seconds(w))
        for w in cp.workloads.values():
            if w.state is not State.SUCCEEDED:
                self.note_submitted(w)

        def seen(w: Workload, tr: Transition) -> None:
            if self._attached is not cp:
                return
            if tr.target is State.PENDING:
                self.note_submitted(w)
            elif tr.target is State.ADMITTED and self._at_submit.get(w.id, 0.0) is None:
                # nothing was known at submission: score the estimate the placing
                # decision could use instead
                del self._at_submit[w.id]
                self.note_submitted(w)
            elif tr.target is State.SUCCEEDED:
                self.note_completed(w, run_seconds(w, tr.time))

        cp.listeners.append(seen)


def run_seconds(w: Workload, finished_at: float | None = None) -> float:
    """Seconds of work a succeeded workload took, as the control plane measured
    them: its saved work plus its last run (after any restore), or, after a
    restart of the engine, the sum of its running intervals."""
    hist = w.history
    end = finished_at if finished_at is not None else (hist[-1].time if hist else 0.0)
    start = None
    for tr in reversed(hist):
        if tr.target is State.RUNNING:
            start = tr.time
            break
    if start is None:
        return 0.0
    restore = w.spec.restart_cost if w.run_base_work > 0 else 0.0
    return max(0.0, w.run_base_work + (end - start) - restore)


def _median(xs: list[float]) -> float | None:
    return xs[len(xs) // 2] if xs else None


def _pick(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)


def seed(estimator: RuntimeEstimator, runs: Iterable[tuple[WorkloadSpec, float]]) -> None:
    """Teach ``estimator`` past runs given as (spec, seconds of work)."""
    for spec, secs in runs:
        estimator.learn(spec, secs)
