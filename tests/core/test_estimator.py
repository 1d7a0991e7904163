"""The learned runtime estimator: what it predicts, from what, and its Gittins index."""

from __future__ import annotations

from typing import Any

import pytest

from mlwe.core import Exited, WorkloadSpec
from mlwe.core.estimator import RuntimeEstimator, name_stem, run_seconds
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload

from .builders import cluster, gpu_node, job, ok, running_on


def spec(name: str = "train-bert-0042", queue: str = "nlp", gpus: int = 8, **kw: object) -> WorkloadSpec:
    return WorkloadSpec(name=name, queue=queue, resources={"gpu": gpus}, **kw)  # type: ignore[arg-type]


def wl(s: WorkloadSpec, wid: str = "x") -> Workload:
    return Workload(id=wid, spec=s, seq=1, submit_time=0.0, deadline=None)


@pytest.mark.parametrize(
    ("name", "stem"),
    [("train-bert-0042", "train-bert-#"), ("philly-123", "philly-#"),
     ("job-3f9a2c1d77", "job-#"), ("plain", "plain")],
)
def test_name_stem(name: str, stem: str) -> None:
    assert name_stem(name) == stem


def test_nothing_known_gives_no_estimate() -> None:
    est = RuntimeEstimator()
    assert est.estimate(wl(spec())) is None
    assert est.gittins_index(wl(spec()), 0.0) is None


def test_the_most_specific_key_with_enough_runs_wins() -> None:
    """While no key has a record of scored predictions (``min_errors``)."""
    est = RuntimeEstimator(min_samples=3, min_errors=4)
    for d in (100.0, 200.0, 300.0):  # same queue, stem and GPUs
        est.learn(spec(name="train-bert-1"), d)
    for d in (5000.0, 6000.0, 7000.0):  # another stem in the same queue
        est.learn(spec(name="eval-9"), d)
    e = est.estimate(wl(spec(name="train-bert-77")))
    assert e is not None
    assert e.total_s == 200.0
    assert e.samples == 3 and e.source == "history"
    assert e.basis == "in queue nlp like train-bert-# with 8 GPUs"
    assert e.describe() == "3m20s from 3 past runs in queue nlp like train-bert-# with 8 GPUs"
    # an unseen stem in the queue falls back to the queue and GPU count (6 runs)
    e2 = est.estimate(wl(spec(name="new-thing")))
    assert e2 is not None and e2.samples == 6


def _erratic_stem(est: RuntimeEstimator) -> None:
    for _ in range(10):  # other work in the queue: steady 1000 s runs
        est.learn(spec(name="eval-1"), 1000.0)
    for d in (100.0, 10000.0, 100.0, 10000.0, 100.0, 10000.0):  # erratic by name
        est.learn(spec(name="train-bert-1"), d)


def test_the_key_whose_own_predictions_erred_least_is_chosen() -> None:
    """Each key is scored on every run it saw complete (its median against the
    run, before learning it); once keys have ``min_errors`` scored, a prediction
    from run times reads the one with the lowest median error, not the most
    specific."""
    est = RuntimeEstimator(min_samples=3, min_errors=3)
    _erratic_stem(est)
    # the stem's own keys predicted 100 or 10000 for the next run and missed by
    # 99% or 99x: median error 0.99; the queue's key, 1000 s throughout: median
    # error 0 (seven steady runs scored, six erratic ones)
    e = est.estimate(wl(spec(name="train-bert-77")))
    assert e is not None
    assert e.basis == "in queue nlp of kind other with 8 GPUs"
    assert e.total_s == 1000.0 and e.samples == 16 and e.p50_error == 0.0
    assert e.describe().endswith("p50 error 0%")
    assert est.remaining_s(wl(spec(name="train-bert-77"), "y"), 0.0) == 1000.0
    # without enough scored predictions, the most specific key with enough runs
    strict = RuntimeEstimator(min_samples=3, min_errors=50)
    _erratic_stem(strict)
    e = strict.estimate(wl(spec(name="train-bert-77")))
    assert e is not None and e.basis == "in queue nlp like train-bert-# with 8 GPUs"
    with pytest.raises(ValueError, match="min_errors"):
        RuntimeEstimator(keep=8, min_errors=9)


def test_seconds_per_iteration_are_read_from_the_most_specific_key() -> None:
    """Estimates from iteration counts keep the most specific key with enough
    runs, whatever the records (by record, ITP's itp:02 lost 13% avg JCT)."""
    est = RuntimeEstimator(min_samples=3, min_errors=3)
    it = {"model_name": "resnet50", "num_iteration": "100"}
    steady = {"model_name": "vgg16", "num_iteration": "100"}
    for _ in range(10):  # the queue's key has the better record (as above)
        est.learn(spec(name="eval-1", labels=steady), 1000.0)
    for d in (100.0, 10000.0, 100.0, 10000.0, 100.0, 10000.0):
        est.learn(spec(name="train-bert-1", labels=it), d)
    e = est.estimate(wl(spec(name="train-bert-77", labels=it)))
    assert e is not None and e.source == "iterations"
    assert e.basis == "of resnet50 (batch ?) with 8 GPUs"


def test_attained_service_conditions_the_estimate() -> None:
    est = RuntimeEstimator(min_samples=1)
    for d in (100.0, 200.0, 1000.0, 4000.0, 9000.0):
        est.learn(spec(), d)
    w = wl(spec())
    assert est.estimate(w, 0.0).total_s == 1000.0  # type: ignore[union-attr]
    # having run 1500 s, only 4000 and 9000 remain possible: median of the tail
    e = est.estimate(w, 1500.0)
    assert e is not None and e.total_s == 9000.0 and e.remaining_s == 7500.0
    # outlived every past run: as long again
    e = est.estimate(w, 20000.0)
    assert e is not None and e.remaining_s == 20000.0


def test_gittins_index_prefers_what_is_likely_to_end_soon() -> None:
    est = RuntimeEstimator(min_samples=1)
    for d in (10.0, 10.0, 10.0, 10000.0):
        est.learn(spec(), d)
    w = wl(spec())
    # at 0: quantum 10 ends 3 of 4 for E[min(S,10)] = 10 -> 0.075; quantum 10000:
    # 4/ (30 + 10000) -> 0.0004; the index is the best: 0.075
    assert est.gittins_index(w, 0.0) == pytest.approx(3 / 40)
    # past 10 s only the 10000 s run is left: 1 / 9990
    assert est.gittins_index(w, 10.0) == pytest.approx(1 / 9990)


def test_iterations_and_user_estimates_are_features() -> None:
    est = RuntimeEstimator(min_samples=2)
    for it, d in ((1000, 100.0), (2000, 200.0)):
        est.learn(spec(labels={"model_name": "resnet50", "num_iteration": str(it)}), d)
    e = est.estimate(wl(spec(labels={"model_name": "resnet50", "num_iteration": "5000"})))
    assert e is not None and e.source == "iterations" and e.total_s == pytest.approx(500.0)
    for user, d in ((100.0, 150.0), (200.0, 300.0)):
        est.learn(spec(name="other", estimated_duration=user), d)
    e = est.estimate(wl(spec(name="other", estimated_duration=1000.0)))
    assert e is not None and e.source == "user-calibrated" and e.total_s == pytest.approx(1500.0)
    fresh = RuntimeEstimator()
    e = fresh.estimate(wl(spec(estimated_duration=42.0)))
    assert e is not None and e.source == "user" and "the user's estimate" in e.describe()


def test_errors_are_scored_before_learning() -> None:
    est = RuntimeEstimator(min_samples=1)
    est.learn(spec(), 100.0)
    w = wl(spec(), "a")
    est.note_submitted(w)  # predicts 100
    est.note_completed(w, 200.0)  # actual 200: error 50%
    stats = est.error_stats()
    assert stats["estimate_p50_rel_error"] == 0.5
    assert stats["estimate_coverage"] == 1.0


def test_attach_learns_from_completed_workloads_only() -> None:
    cp, clock = cluster(gpu_node("a100-0"))
    running_on(cp, job("done", gpu=1), "a100-0")
    running_on(cp, job("running", gpu=1), "a100-0")
    clock.advance(300.0)
    ok(cp.apply([Exited("done", 1, 0)]))
    assert cp.workloads["done"].state is State.SUCCEEDED
    assert run_seconds(cp.workloads["done"]) == 300.0
    est = RuntimeEstimator(min_samples=1)
    est.attach(cp)  # seeds from what the control plane holds: one completed run
    assert est.learned == 1
    clock.advance(700.0)  # the running one has run 1000 s: still not learned
    assert est.learned == 1
    ok(cp.apply([Exited("running", 1, 0)]))
    assert est.learned == 2
    est.attach(cp)  # idempotent
    assert est.learned == 2


def test_deadline_admission_uses_learned_estimates() -> None:
    from mlwe.core.policies.deadline import DeadlineStatus
    from mlwe.core.scheduler import default_scheduler

    from .builders import submit

    cp, clock = cluster(gpu_node("a100-0"))
    sched = default_scheduler()
    sched.plan(cp)  # attach
    assert sched.estimator is not None
    for i in range(3):
        sched.estimator.learn(job(f"old-{i}", gpu=1), 100.0)
    clock.advance(1000.0)
    submit(cp, job("tight-1", gpu=1, deadline=1050.0), job("roomy-2", gpu=1, deadline=5000.0))
    tight = sched.admission(cp, cp.workloads["tight-1"])
    assert tight.status is DeadlineStatus.INFEASIBLE, tight.reason
    assert "needs 1m40s" in tight.reason
    roomy = sched.admission(cp, cp.workloads["roomy-2"])
    assert roomy.status is DeadlineStatus.FEASIBLE, roomy.reason


@pytest.mark.parametrize("min_errors", [3, 8])
def test_kept_predictions_are_exactly_what_a_new_one_would_be(min_errors: int) -> None:
    """The estimator keeps a prediction per workload across learning (no global
    clear): every answer, cached or not, must equal a prediction made from
    scratch at that moment, through keys becoming usable, samples changing,
    errors being noted (and moving which key is chosen) and attained service
    moving."""
    import random

    rng = random.Random(7)
    est = RuntimeEstimator(min_samples=3, keep=8, min_errors=min_errors)
    queues, stems, gpus = ("nlp", "cv"), ("train-bert-1", "eval-2", "tune-3"), (1, 8)
    specs = [
        spec(name=n, queue=q, gpus=g, **extra)  # type: ignore[arg-type]
        for q in queues for n in stems for g in gpus
        for extra in ({}, {"estimated_duration": 900.0}, {"labels": {"num_iteration": "50"}})
    ]
    workloads = [wl(s, f"w{i}") for i, s in enumerate(specs)]
    asked = 0
    for step in range(400):
        s = rng.choice(specs)
        if rng.random() < 0.4:
            w = Workload(id=f"done{step}", spec=s, seq=step, submit_time=0.0, deadline=None)
            est.note_submitted(w)
            est.note_completed(w, rng.choice((60.0, 300.0, 1200.0, 5000.0)) * rng.uniform(0.5, 2))
        for w in rng.sample(workloads, 6):
            a = rng.choice((0.0, 0.0, 100.0, 700.0, 3000.0, 20000.0))
            fresh, _ = est._predict(w.spec, a, est._keys(w.spec))
            assert est.estimate(w, a) == fresh
            assert est.remaining_s(w, a) == (None if fresh is None else fresh.remaining_s)
            asked += 1
    assert asked == 2400 and est.learned > 100


def test_a_history_basis_outlives_learning_that_leaves_its_choice() -> None:
    """A running workload's remaining time is asked at every cycle, and the
    estimator learns at every completion: the basis of a prediction from the
    history of run times (which key's sample) is kept across learning as long
    as its key list's choice stays the same, and read again when it changes."""
    est = RuntimeEstimator(min_samples=3, keep=16, min_errors=3)
    for _ in range(6):  # queue cv's own key: always right (no error), so chosen
        est.learn(spec(name="eval-2", queue="cv", gpus=1), 500.0)
    w = wl(spec(name="eval-2", queue="cv", gpus=1), "w")
    assert est.remaining_s(w, 100.0) == 400.0
    read = 0
    basis_of = est._basis_of

    def counted(*args: Any) -> Any:
        nonlocal read
        read += 1
        return basis_of(*args)

    est._basis_of = counted  # type: ignore[method-assign,assignment]
    for i in range(40):  # other queues: the general keys' records move, cv's choice does not
        est.learn(spec(name="train-bert-1", queue="nlp", gpus=8), 100.0 * (1 + i % 7))
        assert est.remaining_s(w, 100.0 + i) == 400.0 - i
    assert read == 0
    est.learn(spec(name="eval-2", queue="cv", gpus=1), 900.0)  # its own sample grows
    assert est.remaining_s(w, 100.0) == 400.0 and read == 0  # (the median of 500s)
    for _ in range(6):  # now the general key "in queue cv of kind ..." errs less
        est.learn(spec(name="eval-9x", queue="cv", gpus=1), 500.0)
        est.learn(spec(name="eval-2", queue="cv", gpus=1), 5000.0)
    fresh = est._predict(w.spec, 100.0, est._keys(w.spec))[0]
    assert fresh is not None and est.remaining_s(w, 100.0) == fresh.remaining_s
    assert read >= 1


def test_a_deadline_is_urgent_only_within_the_horizon_by_default() -> None:
    """Size-aware order: a deadline job with more slack than the urgency horizon
    (2h) competes by size; with ``urgency_ratio`` 1 it would be urgent while its
    slack is under the work it has left, and go first."""
    from mlwe.core.policies.ordering import SizeAware

    from .builders import submit

    cp, clock = cluster(gpu_node("a100-0"))
    clock.advance(1000.0)
    # 10h of work, deadline 13h away: slack 3h (over the horizon, under 10h)
    submit(cp, job("long-dl", gpu=1, estimated_duration=36_000.0, deadline=1000.0 + 46_800.0),
           job("short", gpu=1, estimated_duration=600.0))
    queued, now = cp.queued_workloads(), cp.now()

    def order(**kw: float) -> list[str]:
        return [w.id for w in SizeAware(RuntimeEstimator(), **kw).order(queued, cp.queues, 8, now)]

    assert order() == ["short", "long-dl"]
    assert order(urgency_ratio=1.0) == ["long-dl", "short"]
    # inside the horizon it is urgent either way
    assert order(urgency_horizon_s=4 * 3600.0) == ["long-dl", "short"]
