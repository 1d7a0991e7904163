"""Replay reports (metrics.json, report.md, plots) and the fragmentation metric.

The report tests replay tiny seeded synthetic traces through the real control
plane; the fragmentation test drives a hand-built cluster through ``apply`` and
checks every sample against values worked out by hand.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from mlwe.core import NodeStatus, SetNodeStatus, WorkloadSpec
from mlwe.sim.baselines import POLICY_SEMANTICS
from mlwe.sim.metrics import Metrics
from mlwe.sim.replay import ReplayConfig, ReplayResult, replay
from mlwe.sim.report import (
    METRICS_FILE,
    REPORT_FILE,
    TABLE_ROWS,
    WALL_CLOCK_KEYS,
    format_table,
    metrics_json,
    samples_of,
    write_report,
)
from mlwe.sim.traces import Trace, synthetic_trace
from tests.core.builders import A100, T4, cluster, gpu_node, job, ok, place_on, submit

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
POLICIES = ("mlwe", "fifo")


def run(
    trace: Trace, policies: tuple[str, ...] = POLICIES, *, check_invariants: bool = True
) -> list[ReplayResult]:
    return [replay(trace, ReplayConfig(policy=p, check_invariants=check_invariants))
            for p in policies]


@pytest.fixture(scope="module")
def results() -> list[ReplayResult]:
    # 40 jobs at 20/h on the 128-GPU synthetic cluster: some fine-tunes with deadlines,
    # and a queue long enough that work waits
    return run(synthetic_trace(n_jobs=40, seed=3))


@pytest.fixture(scope="module")
def written(results: list[ReplayResult], tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_report(results, tmp_path_factory.mktemp("report") / "out")


def squash(text: str) -> str:
    return " ".join(text.split())


# ---------------------------------------------------------------------- report
def test_report_writes_every_file(results: list[ReplayResult], written: list[Path]) -> None:
    assert all(r.metrics["deadline_jobs"] > 0 for r in results)  # the deadline plot applies
    paths = written
    out = paths[0].parent
    assert out.name == "out"  # made by write_report, parents included
    names = [p.name for p in paths]
    assert names[:5] == [METRICS_FILE, REPORT_FILE, "jct_cdf.png", "gpu_util.png",
                         "queue_length.png"]
    assert names[-1] == "deadlines.png"
    assert set(names) <= {*names[:5], "fragmentation.png", "deadlines.png"}
    for p in paths:
        assert p.parent == out and p.is_file()
    for p in paths:
        if p.suffix == ".png":
            data = p.read_bytes()
            assert data[:8] == PNG_MAGIC, p.name
            assert len(data) > 10_000, (p.name, len(data))  # axes, lines and labels drawn


def test_report_md_states_semantics_table_invariants_and_deadlines(
    results: list[ReplayResult], written: list[Path]
) -> None:
    md = (written[0].parent / REPORT_FILE).read_text()
    flat = squash(md)
    assert md.startswith("# Replay report: synthetic")
    assert "WARNING" not in md  # invariants were on
    for policy in POLICIES:
        assert f"### {policy}" in md
        assert squash(POLICY_SEMANTICS[policy]) in flat
    assert "| metric | mlwe | fifo |" in md
    for label, _ in TABLE_ROWS:
        assert f"| {label} |" in md
    assert "- Cluster: 24 nodes, 128 GPUs" in md
    for note in results[0].metrics["trace_notes"]:
        assert f"- {note}" in md
    assert "## Deadline outcomes by priority class" in md
    assert "| mlwe | high (100) |" in md or "| mlwe | urgent (500) |" in md
    assert "- mlwe: on;" in md and "- fifo: on;" in md
    for plot in ("jct_cdf.png", "gpu_util.png", "queue_length.png", "deadlines.png"):
        assert f"]({plot})" in md


def test_metrics_json_is_canonical_and_has_no_wall_clock(
    results: list[ReplayResult], written: list[Path]
) -> None:
    text = (written[0].parent / METRICS_FILE).read_text()
    data = json.loads(text)
    assert text == json.dumps(data, sort_keys=True, indent=2) + "\n" == metrics_json(results)
    assert list(data) == ["fifo", "mlwe"]
    for policy, m in data.items():
        assert not WALL_CLOCK_KEYS & m.keys()
        expect = {k: v for k, v in json.loads(json.dumps(
            next(r for r in results if r.policy == policy).metrics)).items()
            if k not in WALL_CLOCK_KEYS}
        assert m == expect
        for key in ("fragmentation_avg", "fragmentation_by_size_avg", "deadline_met",
                    "deadline_missed", "deadline_outcomes_by_priority", "queue_len_max"):
            assert key in m


def test_metrics_json_is_byte_identical_across_runs_and_changes_with_the_seed(
    tmp_path: Path,
) -> None:
    def write(seed: int, where: str) -> bytes:
        out = tmp_path / where
        write_report(run(synthetic_trace(n_jobs=25, seed=seed)), out)
        return (out / METRICS_FILE).read_bytes()

    first = write(7, "a")
    assert write(7, "b") == first
    other = metrics_json(run(synthetic_trace(n_jobs=25, seed=8))).encode()
    assert other != first


def test_format_table_lists_every_policy_and_row(results: list[ReplayResult]) -> None:
    table = format_table(results)
    lines = table.splitlines()
    assert lines[0] == "trace: synthetic"
    assert lines[1].split() == ["metric", "mlwe", "fifo"]
    assert set(lines[2]) == {"-", " "}
    assert [line.split("  ")[0].strip() for line in lines[3:]] == [
        label.strip() for label, _ in TABLE_ROWS
    ]
    completed = next(line for line in lines if line.startswith("completed / jobs"))
    assert completed.split()[-2:] == ["40/40", "40/40"]
    assert "\t" not in table and "|" not in table


def test_invariants_off_is_said_loudly(tmp_path: Path) -> None:
    (result,) = run(synthetic_trace(n_jobs=10, seed=1), ("mlwe",), check_invariants=False)
    write_report([result], tmp_path)
    md = (tmp_path / REPORT_FILE).read_text()
    assert "**WARNING: INVARIANT CHECKS WERE OFF for mlwe.**" in md
    assert "- mlwe: **OFF (profiling only)**" in md
    assert format_table([result]).splitlines()[-1].split()[-1] == "OFF"


def test_no_deadlines_no_deadline_plot_and_stale_plots_go(tmp_path: Path) -> None:
    (tmp_path / "deadlines.png").write_bytes(b"stale")
    trace = synthetic_trace(n_jobs=12, seed=2, mix={"batch-embedding": 1.0})
    res = run(trace, ("fifo",))
    assert res[0].metrics["deadline_jobs"] == 0
    names = {p.name for p in write_report(res, tmp_path)}
    assert "deadlines.png" not in names
    assert not (tmp_path / "deadlines.png").exists()
    assert "The trace has no deadlines." in (tmp_path / REPORT_FILE).read_text()


def test_report_refuses_what_it_cannot_key(results: list[ReplayResult], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="appears twice"):
        write_report([results[0], results[0]], tmp_path)
    with pytest.raises(ValueError, match="no replay results"):
        write_report([], tmp_path)
    assert not (tmp_path / METRICS_FILE).exists()


def test_replay_samples_mirror_the_control_plane(results: list[ReplayResult]) -> None:
    for r in results:
        samples = samples_of(r)
        assert [(s.t, s.gpus_allocated, s.queued) for s in samples] == list(r.series)
        times = [s.t for s in samples]
        assert times == sorted(set(times))  # no duplicate sample times
        assert all(b - a == pytest.approx(600.0) for a, b in itertools.pairwise(times))
        for s in samples:
            assert 0 <= s.unusable_by_size_gpus <= s.unusable_gpus <= s.free_gpus <= 128
            assert (s.fragmentation is None) == (s.queued_gpu == 0 or s.free_gpus == 0)
            assert 0.0 <= s.gpu_util <= 1.0 + 1e-9


# ---------------------------------------------------------------- fragmentation
def test_fragmentation_on_a_hand_built_cluster() -> None:
    """a1, a2: 8 x A100; t1: 4 x T4. From t=0 big (6 GPUs) holds a1 and mid (4)
    holds a2, so 2 + 4 + 4 = 10 GPUs are wholly free. Samples every 600 s read the
    state just before the first transition at or after their time:

    ===== ======================================== ====== ======== ======= ====
    t     waiting                                   free  unusable by size frag
    ===== ======================================== ====== ======== ======= ====
    0     nothing (before the first submission)     20    0        0       None
    600   w5 (5 x A100)                             10    10       6       1.0
    1200  w5, t3 (3 x T4: t1 fits it)               10    6        6       0.6
    1800  w5, t3; t1 is down (not counted)          6     6        6       1.0
    2400  w5, t3, frac (0.5 of an A100 -> 1 whole)  6     0        0       0.0
    ===== ======================================== ====== ======== ======= ====
    """
    cp, clock = cluster(gpu_node("a1", A100, 8), gpu_node("a2", A100, 8), gpu_node("t1", T4, 4))
    m = Metrics(cp, durations={}, total_gpus=20.0, sample_every_s=600.0)

    def cpu_job(name: str) -> WorkloadSpec:  # a transition that moves the sampler on
        return job(name, cpu=1)

    submit(cp, job("big", gpu=6, models=[A100]), job("mid", gpu=4, models=[A100]))
    ok(cp.apply([place_on(cp, "big", "a1"), place_on(cp, "mid", "a2")]))
    submit(cp, job("w5", gpu=5, models=[A100]))
    clock.set(700)
    submit(cp, job("t3", gpu=3, models=[T4]))
    clock.set(1300)
    submit(cp, cpu_job("c1"))  # takes the 1200 sample
    ok(cp.apply([SetNodeStatus("t1", NodeStatus.DOWN, "test")]))
    clock.set(1900)
    submit(cp, job("frac", gpu=0.5, models=[A100]))
    clock.set(2500)
    submit(cp, cpu_job("c2"))
    summary = m.summary(2500.0, 0.0)

    samples = m.series.samples
    assert [s.t for s in samples] == [0.0, 600.0, 1200.0, 1800.0, 2400.0]
    assert [s.free_gpus for s in samples] == [20, 10, 10, 6, 6]
    assert [s.unusable_gpus for s in samples] == [0, 10, 6, 6, 0]
    assert [s.unusable_by_size_gpus for s in samples] == [0, 6, 6, 6, 0]
    assert [s.fragmentation for s in samples] == [None, 1.0, 0.6, 1.0, 0.0]
    assert [s.queued for s in samples] == [0, 1, 2, 3, 4]
    assert [s.queued_gpu for s in samples] == [0, 1, 2, 2, 3]
    # the wait so far of what waits: w5 since 0, t3 since 700, c1 since 1300
    assert samples[3].queue_delay_avg_s == pytest.approx((1800 + 1100 + 500) / 3)
    assert samples[3].queue_delay_max_s == 1800.0
    assert [s.gpus_allocated for s in samples] == [0.0, 10.0, 10.0, 10.0, 10.0]
    assert list(m.series) == [(s.t, s.gpus_allocated, s.queued) for s in samples]

    assert summary["fragmentation_avg"] == round((1.0 + 0.6 + 1.0 + 0.0) / 4, 6) == 0.65
    assert summary["fragmentation_by_size_avg"] == 0.55  # (0.6 + 0.6 + 1.0 + 0) / 4
    assert summary["fragmentation_unusable_gpus_avg"] == 5.5  # (10 + 6 + 6 + 0) / 4
    assert summary["fragmentation_samples"] == 4
    assert summary["samples"] == 5
    assert summary["queue_len_max"] == 4
    # the mirror the samples read agrees with the control plane's own index
    assert m.free_devices_mirror() == {
        n: cp.capacity.free_devices(n) for n in cp.capacity.node_names()
    }


def test_fragmentation_is_none_when_no_gpu_work_waits() -> None:
    cp, clock = cluster(gpu_node("a1", A100, 8))
    m = Metrics(cp, durations={}, total_gpus=8.0, sample_every_s=600.0)
    submit(cp, job("c1", cpu=1))  # CPU work waiting does not make GPUs unusable
    clock.set(700)
    submit(cp, job("c2", cpu=1))
    summary = m.summary(700.0, 0.0)
    assert [(s.free_gpus, s.unusable_gpus, s.fragmentation) for s in m.series.samples] == [
        (8, 0, None), (8, 0, None)
    ]
    assert summary["fragmentation_avg"] is None
    assert summary["fragmentation_samples"] == 0


def test_sampled_state_tracks_the_control_plane_through_a_replay(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The free devices the samples read, kept from transitions, equal the control
    plane's index after every scheduling cycle (with preemptions and a node failure)."""
    import mlwe.sim.replay as replay_module

    made: list[Metrics] = []

    class Recording(Metrics):
        def __post_init__(self) -> None:
            super().__post_init__()
            made.append(self)

    monkeypatch.setattr(replay_module, "Metrics", Recording)
    trace = synthetic_trace(n_jobs=150, seed=2)
    node = next(n.name for n in trace.cluster.all_nodes() if n.gpus)
    checked = [0]

    def check(t: float, jobs: int, events: int) -> None:
        (m,) = made
        cap = m.cp.capacity
        assert m.free_devices_mirror() == {n: cap.free_devices(n) for n in m.free_devices_mirror()}
        checked[0] += 1

    result = replay(trace, ReplayConfig(policy="mlwe", node_failures=[(7200.0, node, 3600.0)],
                                        progress=check))
    assert checked[0] > 50
    assert result.metrics["preemptions"] > 0
    assert result.series is made[0].series
    assert result.cp.capacity.status(node) is NodeStatus.READY  # it came back
