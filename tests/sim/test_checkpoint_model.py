"""The replay's checkpoint model and the "-free" baselines, on hand-checked traces.

Cases follow tests/sim/test_baselines.py: one node, immediate eviction in the
costed cases, exact completion times worked out by hand in the comments.
"""

from __future__ import annotations

import pytest

from mlwe.sim.baselines import ORACLE_POLICIES, POLICIES, POLICY_PLACEMENT, POLICY_SEMANTICS
from mlwe.sim.checkpoint import (
    DEFAULT_CHECKPOINT,
    FREE_PREEMPTION,
    NO_CHECKPOINT,
    CheckpointModel,
    parse_checkpoint_model,
)
from mlwe.sim.replay import ReplayConfig, replay
from tests.sim.test_baselines import jcts, job, trace


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("free", FREE_PREEMPTION),
        ("none", NO_CHECKPOINT),
        (" FREE ", FREE_PREEMPTION),
        ("periodic:1800", CheckpointModel("periodic", 1800.0, 0.0, 60.0)),
        ("periodic:600,cost=5,restart=30", CheckpointModel("periodic", 600.0, 5.0, 30.0)),
        ("periodic:600,restart=0", CheckpointModel("periodic", 600.0, 0.0, 0.0)),
    ],
)
def test_parse_checkpoint_model(text: str, want: CheckpointModel) -> None:
    got = parse_checkpoint_model(text)
    assert got == want
    assert parse_checkpoint_model(got.text()) == got


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("sometimes", "expected 'none', 'free' or 'periodic"),
        ("periodic:", "expected"),
        ("periodic:0", "interval '0' must be positive"),
        ("periodic:-5", "must be positive"),
        ("periodic:nan", "finite"),
        ("periodic:abc", "'abc' is not a number"),
        ("periodic:60,cost=-1", "cost '-1' must be zero or more"),
        ("periodic:60,delay=3", "unknown option 'delay'"),
    ],
)
def test_bad_checkpoint_models_say_what_is_wrong(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_checkpoint_model(text)


def test_default_model_is_periodic_and_free_of_pause_cost() -> None:
    assert DEFAULT_CHECKPOINT.text() == "periodic:1800,cost=0,restart=60"
    assert ReplayConfig().checkpoint == DEFAULT_CHECKPOINT


def _run(policy: str, tr, checkpoint: CheckpointModel = DEFAULT_CHECKPOINT):  # type: ignore[no-untyped-def]
    r = replay(tr, ReplayConfig(policy=policy, eviction_delay_s=0.0, checkpoint=checkpoint))
    assert r.metrics["rejected_batches"] == 0
    assert r.cp.validate_state() == []
    return r


# tiresias (3 queues, 3250/7200 GPU-s), 1 GPU: a is demoted at 3250 and b
# preempts it. Under the default model a (no interval of its own) saved 1800 s,
# loses 1450 s; b 3250-3750; a restores 60 s and runs its 2200 s left: 3750-6010.
def test_default_model_gives_trace_jobs_periodic_checkpoints() -> None:
    r = _run("tiresias", trace(job("a", 0, 4000), job("b", 10, 500)))
    assert jcts(r) == pytest.approx({"a": 6010.0, "b": 3740.0})
    assert r.metrics["gpu_hours_lost_to_preemption"] == round(1450 / 3600, 3)
    assert r.metrics["checkpoint_model"] == "periodic:1800,cost=0,restart=60"
    assert "every 1800 s of work" in r.metrics["checkpoint_semantics"]


# the same under "none": all 3250 s lost, a runs 4000 s again from 3750: 7750.
def test_no_checkpoint_model_loses_the_whole_attempt() -> None:
    r = _run("tiresias", trace(job("a", 0, 4000), job("b", 10, 500)), NO_CHECKPOINT)
    assert jcts(r) == pytest.approx({"a": 7750.0, "b": 3740.0})
    assert r.metrics["checkpoint_model"] == "none"


# "free": nothing lost, no restore: b 3250-3750, a 3750-4500 (750 s left).
def test_free_model_loses_nothing() -> None:
    r = _run("tiresias", trace(job("a", 0, 4000), job("b", 10, 500)), FREE_PREEMPTION)
    assert jcts(r) == pytest.approx({"a": 4500.0, "b": 3740.0})
    assert r.metrics["gpu_hours_lost_to_preemption"] == 0
    assert r.cp.workloads["a"].work_done == pytest.approx(3250.0)


# a job's own interval wins over the periodic model: a saves every 100 s (3200 s
# saved at 3250), restores 60 s: 3750 + 60 + 800 = 4610.
def test_a_jobs_own_interval_wins() -> None:
    r = _run("tiresias", trace(job("a", 0, 4000, checkpoint_interval=100), job("b", 10, 500)))
    assert jcts(r) == pytest.approx({"a": 4550.0, "b": 3740.0})


# tiresias-free forces the free model whatever the replay says, with the eviction
# delay too: the same schedule as above even with 5 s of eviction delay asked.
def test_tiresias_free_forces_free_preemption() -> None:
    tr = trace(job("a", 0, 4000), job("b", 10, 500))
    r = replay(tr, ReplayConfig(policy="tiresias-free", checkpoint=NO_CHECKPOINT))
    assert jcts(r) == pytest.approx({"a": 4500.0, "b": 3740.0})
    assert r.metrics["checkpoint_model"] == "free"
    assert "forced by policy tiresias-free" in r.metrics["checkpoint_semantics"]


# 2 GPUs, free preemption. a and b (20000 s each) run; c (4000 s) waits in queue
# 0. At 3250 a and b reach queue 1 and c preempts b (the later arrival). a reaches
# 7200 GPU-s at 7200: queue 2, below the waiting b (queue 1), which preempts it
# (with two queues a would stay level with b and run on). c ends at 7250 and a
# resumes then: b 7200-23950 (16750 s left), a 7250-20050 (12800 s left).
def test_tiresias_has_three_queues() -> None:
    tr = trace(job("a", 0, 20000), job("b", 0, 20000), job("c", 10, 4000), gpus=2)
    r = _run("tiresias-free", tr)
    assert jcts(r) == pytest.approx({"a": 20050.0, "b": 23950.0, "c": 7240.0})
    assert r.metrics["preemptions"] == 2


# srtf-free ranks by exact remaining time: at 100, a has 900 s left and b 600 s
# (the same power-of-two level, where "srtf" does not preempt): b preempts,
# free: b 100-700, a 700-1600.
def test_srtf_free_preempts_within_a_power_of_two_level() -> None:
    tr = trace(job("a", 0, 1000), job("b", 100, 600))
    assert jcts(_run("srtf", tr)) == pytest.approx({"a": 1000.0, "b": 1500.0})
    r = _run("srtf-free", tr)
    assert jcts(r) == pytest.approx({"a": 1600.0, "b": 600.0})
    assert r.metrics["gpu_hours_lost_to_preemption"] == 0


# free victims are the last in order: 2 GPUs, a (900 s) and b (700 s) running;
# c (100 s) arrives at 100: srtf-free evicts a (most remaining), not b.
def test_srtf_free_evicts_the_job_with_most_remaining() -> None:
    tr = trace(job("a", 0, 1000), job("b", 0, 800), job("c", 100, 100), gpus=2)
    r = _run("srtf-free", tr)
    assert jcts(r) == pytest.approx({"a": 1100.0, "b": 800.0, "c": 100.0})


def test_free_baselines_are_registered_and_labelled() -> None:
    assert {"tiresias-free", "srtf-free"} <= set(POLICIES)
    assert "srtf-free" in ORACLE_POLICIES and "tiresias-free" not in ORACLE_POLICIES
    assert "free" in POLICY_SEMANTICS["tiresias-free"]
    assert "7200" in POLICY_SEMANTICS["tiresias-free"]
    assert "oracle" in POLICY_SEMANTICS["srtf-free"]
    assert set(POLICY_PLACEMENT) == set(POLICIES)


def test_report_names_checkpoint_model_and_placement(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from mlwe.sim.report import write_report

    r = _run("tiresias", trace(job("a", 0, 4000), job("b", 10, 500)))
    write_report([r], tmp_path)
    text = (tmp_path / "report.md").read_text()
    assert "Checkpoint model `periodic:1800,cost=0,restart=60`" in text
    assert "Placement: best-fit" in text
