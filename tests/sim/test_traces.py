"""Trace loaders on the real trace files (slices, plus one full load of each).

Rows asserted here were read off the files by hand: line numbers are 1-based
with the header on line 1, as in the loaders' error messages.
"""

from __future__ import annotations

import csv
import shutil
import time
from datetime import datetime
from pathlib import Path

import pytest

from mlwe.core import ManualClock, Submit, WorkloadSpec, build_control_plane
from mlwe.sim.traces import (
    TRACE_CATALOG,
    TRACES_DIR_ENV,
    Trace,
    TraceError,
    TraceJob,
    gang_shape,
    jitter_submits,
    load_alibaba,
    load_generic_csv,
    load_itp,
    load_philly,
    load_trace,
    parse_cluster_spec,
    resolve_traces_dir,
    synthetic_cluster,
    synthetic_trace,
)

TRACES = resolve_traces_dir()


def job(trace: Trace, job_id: str) -> TraceJob:
    found = [j for j in trace.jobs if j.job_id == job_id]
    assert len(found) == 1, job_id
    return found[0]


def shape(j: TraceJob) -> tuple[int, int, int, int]:
    """(replicas, milli-GPU, milli-CPU, MiB) per replica."""
    r = j.spec.resources
    return j.spec.replicas, r.gpu, r.cpu, r.memory


def note_with(trace: Trace, text: str) -> str:
    found = [n for n in trace.notes if text in n]
    assert found, f"no note mentions {text!r}: {trace.notes}"
    return found[0]


def offered_load(trace: Trace) -> float:
    submits = [j.submit_time for j in trace.jobs]
    gpu_s = sum(j.spec.replicas * j.spec.resources.gpu / 1000 * j.duration for j in trace.jobs)
    return gpu_s / (max(submits) - min(submits))


def cluster_gpus(trace: Trace) -> int:
    return sum(n.gpus for n in trace.cluster.nodes) + sum(
        p.gpus * p.count for p in trace.cluster.pools
    )


def assert_sorted_from_zero(trace: Trace) -> None:
    keys = [(j.submit_time, j.line) for j in trace.jobs]
    assert keys == sorted(keys)
    assert trace.jobs[0].submit_time == 0.0


# ---------------------------------------------------------------- locating traces


def test_traces_dir_from_argument_env_and_repo(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert resolve_traces_dir(tmp_path) == tmp_path
    monkeypatch.setenv(TRACES_DIR_ENV, str(tmp_path))
    assert resolve_traces_dir() == tmp_path
    monkeypatch.delenv(TRACES_DIR_ENV)
    assert (resolve_traces_dir() / "philly" / "jobs.csv").is_file()
    monkeypatch.chdir(tmp_path)  # outside the repo: found relative to the module instead
    assert resolve_traces_dir() == TRACES


def test_missing_traces_dir_names_the_path(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    gone = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        resolve_traces_dir(gone)
    monkeypatch.setenv(TRACES_DIR_ENV, str(gone))
    with pytest.raises(FileNotFoundError, match=rf"nowhere.*\${TRACES_DIR_ENV}"):
        load_trace("philly")
    with pytest.raises(FileNotFoundError, match=r"philly[/\\]jobs.csv"):
        load_philly(traces_dir=tmp_path)


# ---------------------------------------------------------------- Philly


@pytest.fixture(scope="module")
def philly_timed() -> tuple[Trace, float]:
    t0 = time.perf_counter()
    trace = load_trace("philly")
    return trace, time.perf_counter() - t0


@pytest.fixture(scope="module")
def philly(philly_timed: tuple[Trace, float]) -> Trace:
    return philly_timed[0]


def test_philly_full_load_counts(philly_timed: tuple[Trace, float]) -> None:
    # load time is a benchmark figure (quoted in the README), not a test: CI machines are noisy
    trace, _elapsed = philly_timed
    assert len(trace.jobs) == 82_247
    assert trace.skipped == 0
    assert len(trace.cluster.nodes) == 552
    assert cluster_gpus(trace) == 3_205
    assert sum(1 for n in trace.cluster.nodes if n.gpus == 0) == 13
    assert {q.name for q in trace.cluster.queues} == {j.spec.queue for j in trace.jobs}
    assert len(trace.cluster.queues) == 15


def test_philly_is_sorted_and_starts_at_zero(philly: Trace) -> None:
    assert_sorted_from_zero(philly)
    first = philly.jobs[0]  # 2017-09-04 10:30:41, line 31568 of an unsorted file
    assert (first.job_id, first.line, first.duration) == ("philly-31568", 31568, 2_240_194.0)
    assert shape(first) == (1, 8000, 32_000, 262_144)
    assert first.spec.queue == "vc-7f04ca"


def test_philly_row_mapping(philly: Trace) -> None:
    # line 2: 2017-10-09 07:01:55,66.0,1,66.0,11cb48
    j = job(philly, "philly-2")
    t0 = datetime(2017, 9, 4, 10, 30, 41)
    assert j.submit_time == (datetime(2017, 10, 9, 7, 1, 55) - t0).total_seconds()
    assert (j.line, j.duration) == (2, 66.0)
    assert shape(j) == (1, 1000, 4000, 32_768)
    spec = j.spec
    assert (spec.id, spec.name, spec.queue, spec.priority) == (
        "philly-2",
        "philly-2",
        "vc-11cb48",
        50,
    )
    assert spec.kind == "training"
    assert spec.estimated_duration is None and spec.deadline is None
    assert spec.gpu_models == ()


@pytest.mark.parametrize(
    ("line", "gpus", "expected"),
    [
        (4633, 16, (2, 8000, 32_000, 262_144)),  # 16 -> 2 x 8
        (9938, 12, (2, 6000, 24_000, 196_608)),  # 12 -> 2 x 6 (largest divisor <= 8)
        (9942, 24, (3, 8000, 32_000, 262_144)),  # 24 -> 3 x 8
        (23509, 128, (16, 8000, 32_000, 262_144)),  # 128 -> 16 x 8
    ],
)
def test_philly_gangs(
    philly: Trace, line: int, gpus: int, expected: tuple[int, int, int, int]
) -> None:
    j = job(philly, f"philly-{line}")
    assert shape(j) == expected
    assert j.spec.replicas * j.spec.resources.gpu == gpus * 1000


def test_philly_machines_and_notes(philly: Trace) -> None:
    m0 = next(n for n in philly.cluster.nodes if n.name == "m0")
    assert (m0.gpu_model, m0.gpus, m0.cpu, m0.memory) == ("PHILLY-GPU", 8, 40_000, 524_288)
    assert philly.catalog["PHILLY-GPU"].vram_mib == 12_288
    note_with(philly, "PHILLY-GPU")
    note_with(philly, "gang rule")
    note_with(philly, "no user estimates")
    note_with(philly, "552 machines")


def test_philly_limit_is_a_prefix_in_submit_order(philly: Trace) -> None:
    head = load_trace("philly", limit=100)
    assert head.jobs == philly.jobs[:100]
    note_with(head, "first 100 jobs")


def test_template_specs_equal_fully_validated_ones(philly: Trace) -> None:
    # most Philly specs are copies of a validated template with the id swapped
    for j in philly.jobs[::997]:
        data = j.spec.model_dump()
        r = j.spec.resources  # dumped in engine units; a bare number would mean GPUs / cores
        data["resources"] = {"gpu": f"{r.gpu}m", "cpu": f"{r.cpu}m", "memory": r.memory}
        again = WorkloadSpec.model_validate(data, context={"catalog": philly.catalog})
        assert again == j.spec
        assert j.spec.id == j.job_id
    a, b = philly.jobs[1].spec, philly.jobs[2].spec
    assert a.labels is not b.labels and a.node_selector is not b.node_selector


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_philly_bad_row_names_file_and_line(tmp_path: Path) -> None:
    shutil.copytree(
        TRACES / "philly", tmp_path / "philly", ignore=shutil.ignore_patterns("jobs.csv")
    )
    write(
        tmp_path / "philly" / "jobs.csv",
        "timestamp,duration,num_gpus,gpu_time,cluster\n"
        "2017-10-09 07:01:55,66.0,1,66.0,11cb48\n"
        "2017-10-09 07:02:00,abc,1,66.0,11cb48\n"
        "2017-10-09 25:02:00,10,1,10,11cb48\n"
        "2017-10-09 07:03:00,10,0,0,11cb48\n",
    )
    with pytest.raises(TraceError) as e:
        load_philly(traces_dir=tmp_path)
    assert str(e.value) == "philly/jobs.csv:3: duration 'abc' is not a number"
    trace = load_philly(traces_dir=tmp_path, skip_bad_rows=True)
    assert (len(trace.jobs), trace.skipped) == (1, 3)
    note_with(trace, "3 bad row(s) skipped")


# ---------------------------------------------------------------- ITP


@pytest.fixture(scope="module")
def itp4() -> Trace:
    return load_itp(4)


@pytest.mark.parametrize(
    ("name", "count"),
    [("itp:01", 1_595), ("itp:2", 5_778), ("itp:03", 3_011), ("itp:05", 3_629)],
)
def test_itp_row_counts(name: str, count: int) -> None:
    trace = load_trace(name)
    assert len(trace.jobs) == count
    assert trace.name == f"itp:{int(name.split(':')[1]):02d}"
    assert_sorted_from_zero(trace)


def test_itp_row_mapping_and_deadlines(itp4: Trace) -> None:
    trace = itp4
    assert (trace.name, len(trace.jobs)) == ("itp:04", 15_802)
    assert_sorted_from_zero(trace)
    # line 2: c9c620ea-...,5810,3950230,inception3,314395,64,16,288476
    j = trace.jobs[0]
    assert (j.job_id, j.line, j.submit_time, j.duration) == (
        "c9c620ea-4336-c1a9-8abe-e26bd13076b8",
        2,
        0.0,
        288_476.0,
    )
    assert j.spec.deadline == 314_395 - 5_810
    assert shape(j) == (2, 8000, 32_000, 262_144)  # 16 GPUs -> 2 x 8
    assert j.spec.estimated_duration is None
    assert j.spec.labels == {
        "model_name": "inception3",
        "batch_size": "64",
        "num_iteration": "3950230",
    }
    with (TRACES / "itp" / "cluster04.csv").open() as f:
        rows = {r["job_id"]: r for r in csv.DictReader(f)}
    for tj in trace.jobs:
        row = rows[tj.job_id]
        assert tj.spec.deadline is not None
        assert tj.spec.deadline - tj.submit_time == float(row["deadline"]) - float(
            row["submission_time"]
        )
        assert tj.spec.replicas * tj.spec.resources.gpu == int(row["num_gpu"]) * 1000


def test_itp_sizing_rule_puts_load_near_85_percent(itp4: Trace) -> None:
    trace = itp4
    gpus = cluster_gpus(trace)
    assert (len(trace.cluster.nodes), gpus) == (73, 584)
    assert 0.80 <= offered_load(trace) / gpus <= 0.90
    sizing = note_with(trace, "cluster size is not in the trace")
    assert "73 nodes" in sizing and "85%" in sizing and "last submit - first submit" in sizing
    assert trace.catalog["ITP-GPU"].vram_mib == 32_768


def test_itp_sizing_says_why_load_is_low_when_the_largest_job_decides() -> None:
    trace = load_itp(1)  # 28 GPUs of load, but 64-GPU jobs need 8 nodes
    assert len(trace.cluster.nodes) == 8
    note_with(trace, "because the largest job needs that many nodes")


def test_itp_sizes_on_the_loaded_slice() -> None:
    trace = load_trace("itp:02", limit=500)
    assert len(trace.jobs) == 500
    share = offered_load(trace) / cluster_gpus(trace)
    assert 0.80 <= share <= 0.90, share


@pytest.mark.parametrize(
    ("name", "error", "match"),
    [
        ("itp:07", FileNotFoundError, "cluster07.csv.*cluster01.csv"),
        ("itp:x", TraceError, "expected 'itp:NN'"),
        ("no/such/file.csv", FileNotFoundError, "neither a known trace"),
    ],
)
def test_bad_trace_names(name: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_trace(name)


# ---------------------------------------------------------------- Alibaba


@pytest.fixture(scope="module")
def alibaba() -> Trace:
    return load_trace("alibaba")


def test_alibaba_counts_nodes_and_catalogue(alibaba: Trace) -> None:
    assert len(alibaba.jobs) == 8_152
    assert len(alibaba.cluster.nodes) == 1_213
    assert cluster_gpus(alibaba) == 6_212
    assert {n.gpu_model for n in alibaba.cluster.nodes} == {
        "P100",
        "T4",
        "V100-16GB",
        "V100-32GB",
        "A10",
        "G2",
        "G3",
    }
    g3 = next(n for n in alibaba.cluster.nodes if n.name == "openb-node-0022")
    assert (g3.gpu_model, g3.gpus, g3.cpu, g3.memory) == ("G3", 8, 128_000, 786_432)
    assert alibaba.catalog["G2"].vram_mib > 0 and alibaba.catalog["G3"].vram_mib > 0
    note_with(alibaba, "G2 and G3 are undisclosed")
    assert_sorted_from_zero(alibaba)


@pytest.mark.parametrize(
    ("pod", "submit", "duration", "shape_", "priority", "kind", "phase"),
    [
        # line 3: 6000,12288,1,460,,LS,Running,427061,12902960,427061 -> a 0.46 GPU share
        (
            "openb-pod-0001",
            427_061,
            12_902_960 - 427_061,
            (1, 460, 6000, 12_288),
            100,
            "inference",
            "Running",
        ),
        # line 35: BE, Failed
        ("openb-pod-0033", 9_965_463, 182, (1, 1000, 3152, 5600), 10, "other", "Failed"),
        # line 131: Guaranteed
        ("openb-pod-0129", 10_035_396, 957, (1, 1000, 12_000, 24_576), 80, "other", "Running"),
        # line 19: Burstable, 8 whole GPUs in one replica
        (
            "openb-pod-0017",
            9_437_497,
            1_332_357,
            (1, 8000, 88_000, 327_680),
            50,
            "other",
            "Succeeded",
        ),
        # line 7: CPU-only
        (
            "openb-pod-0005",
            2_759_674,
            12_902_960 - 2_759_676,
            (1, 0, 20_000, 65_536),
            100,
            "inference",
            "Running",
        ),
        # line 63: never scheduled -> deletion - creation
        ("openb-pod-0061", 10_001_278, 125, (1, 1000, 11_908, 47_104), 10, "other", "Pending"),
        # line 7287: deletion == creation -> raised to 1 s
        ("openb-pod-7285", 12_774_042, 1, (1, 230, 8000, 30_517), 10, "other", "Pending"),
    ],
)
def test_alibaba_pod_mapping(
    alibaba: Trace,
    pod: str,
    submit: float,
    duration: float,
    shape_: tuple[int, int, int, int],
    priority: int,
    kind: str,
    phase: str,
) -> None:
    j = job(alibaba, pod)
    assert (j.submit_time, j.duration, shape(j)) == (submit, duration, shape_)
    assert (j.spec.priority, j.spec.kind, j.spec.labels["pod_phase"]) == (priority, kind, phase)
    assert j.spec.gpu_models == () and j.spec.estimated_duration is None


def alibaba_dir(tmp_path: Path, pod_rows: str) -> Path:
    shutil.copy(TRACES / "alibaba-openb" / "nodes.csv", write(tmp_path / "alibaba-openb" / "x", ""))
    (tmp_path / "alibaba-openb" / "x").rename(tmp_path / "alibaba-openb" / "nodes.csv")
    write(
        tmp_path / "alibaba-openb" / "pods.csv",
        "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,pod_phase,creation_time,"
        "deletion_time,scheduled_time\n" + pod_rows,
    )
    return tmp_path


def test_alibaba_gpu_spec_becomes_gpu_models(tmp_path: Path) -> None:
    root = alibaba_dir(
        tmp_path,
        "p-a,4000,8192,1,500,V100M16|V100M32,BE,Running,10,110,12\n"
        "p-b,4000,8192,2,1000,G2,LS,Succeeded,20,50,20\n",
    )
    trace = load_alibaba(traces_dir=root)
    a, b = job(trace, "p-a"), job(trace, "p-b")
    assert a.spec.gpu_models == ("V100-16GB", "V100-32GB")
    assert (a.submit_time, a.duration, shape(a)) == (0.0, 98.0, (1, 500, 4000, 8192))
    assert b.spec.gpu_models == ("G2",)
    assert shape(b) == (1, 2000, 4000, 8192)


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ("p,4000,8192,1,500,K80,BE,Running,10,110,12", "gpu_spec model 'K80'"),
        ("p,4000,8192,1,500,,XX,Running,10,110,12", "qos 'XX'"),
        ("p,4000,8192,1,500,,BE,Running,10,5,", "deletion_time 5 is before creation_time 10"),
        ("p,4000,8192,1,500,,BE,Running,10,50,60", "deletion_time 50 is before scheduled_time 60"),
        ("p,4000,8192,1,0,,BE,Running,10,110,12", "gpu_milli 0 is not in 1..1000"),
        ("p,4000,8192,0,0,T4,BE,Running,10,110,12", "gpu_spec given for a pod that asks no GPU"),
        ("p,4k,8192,1,500,,BE,Running,10,110,12", "cpu_milli '4k' is not a number"),
    ],
)
def test_alibaba_bad_rows(tmp_path: Path, row: str, message: str) -> None:
    root = alibaba_dir(tmp_path, "ok,4000,8192,1,500,,BE,Running,0,100,0\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        load_alibaba(traces_dir=root)
    assert str(e.value).startswith("alibaba-openb/pods.csv:3: ")
    assert message in str(e.value)
    assert load_alibaba(traces_dir=root, skip_bad_rows=True).skipped == 1


# ---------------------------------------------------------------- generic CSV

GENERIC_HEADER = (
    "job_id,submit_time,duration,num_gpu,deadline,priority,queue,gpu_model,estimated_duration\n"
)


def test_generic_csv_mapping(tmp_path: Path) -> None:
    path = write(
        tmp_path / "jobs.csv",
        GENERIC_HEADER
        + "b,1500,600,8,4000,high,team-a,A100-80GB|H100-80GB,700\n"
        + "a,1000,0.2,1,,7,,,\n"
        + "c,1000,60,0,,,team-b,,\n"
        + "d,2000,60,0.5,,batch,,T4,\n"
        + "e,2500,60,16,,,,,\n",
    )
    trace = load_trace(str(path))
    assert trace.name == str(path)
    assert [j.job_id for j in trace.jobs] == ["a", "c", "b", "d", "e"]  # ties keep file order
    a, c, b, d, e = trace.jobs
    assert (a.submit_time, a.duration, a.line, a.spec.priority) == (0.0, 1.0, 3, 7)  # 0.2 s -> 1 s
    assert (b.submit_time, b.spec.deadline, b.spec.estimated_duration) == (500.0, 3000.0, 700.0)
    assert (b.spec.priority, b.spec.queue, b.spec.gpu_models) == (
        100,
        "team-a",
        ("A100-80GB", "H100-80GB"),
    )
    assert shape(b) == (1, 8000, 32_000, 262_144)
    assert shape(c) == (1, 0, 4000, 32_768) and c.spec.queue == "team-b"
    assert (shape(d), d.spec.gpu_models, d.spec.priority) == ((1, 500, 4000, 32_768), ("T4",), 20)
    assert shape(e) == (2, 8000, 32_000, 262_144)
    assert a.spec.estimated_duration is None and a.spec.deadline is None
    assert {q.name for q in trace.cluster.queues} == {"team-a", "team-b"}
    assert {n.gpu_model for n in trace.cluster.nodes} == {"A100-80GB", "T4", "TRACE-GPU"}
    note_with(trace, "(1 job(s) affected)")


@pytest.mark.parametrize(
    ("row", "line", "message"),
    [
        ("x,10,abc,1,,,,,", 3, "duration 'abc' is not a number"),
        ("x,10,-5,1,,,,,", 3, "duration '-5' is negative"),
        ("x,10,60,,,,,,", 3, "num_gpu is missing"),
        ("x,10,60,-1,,,,,", 3, "num_gpu '-1' is negative"),
        ("x,10,60,1.5,,,,,", 3, "num_gpu '1.5': above 1, GPUs must be whole"),
        ("x,10,60,1,,,,K80,", 3, "gpu_model K80 is not in the GPU catalogue"),
        ("x,10,60,1,5,,,,", 3, "deadline 5 is not after submit_time 10"),
        ("x,10,60,1,,sometime,,,", 3, "priority: Value error, unknown priority class 'sometime'"),
        ("x,10,60,1,,,,,-3", 3, "estimated_duration -3 is not positive"),
        ("x,10,60,1,,,,", 3, "expected 9 fields, got 8"),
        ("bad id!,10,60,1,,,,,", 3, "job_id: Value error, must start with a letter or digit"),
        ("ok,10,60,1,,,,,", 3, "duplicate job_id 'ok'"),
        ("x,10,60,1,,,bad queue,,", 3, "queue: Value error"),
    ],
)
def test_generic_csv_bad_rows(tmp_path: Path, row: str, line: int, message: str) -> None:
    path = write(tmp_path / "jobs.csv", GENERIC_HEADER + "ok,0,60,1,,,,,\n" + row + "\n")
    with pytest.raises(TraceError) as e:
        load_generic_csv(path)
    assert str(e.value).startswith(f"{path}:{line}: "), str(e.value)
    assert message in str(e.value)
    trace = load_generic_csv(path, skip_bad_rows=True)
    assert (len(trace.jobs), trace.skipped) == (1, 1)


def test_generic_csv_missing_column_and_empty_file(tmp_path: Path) -> None:
    path = write(tmp_path / "jobs.csv", "job_id,submit_time,duration\nx,0,1\n")
    with pytest.raises(TraceError, match=rf"^{path}:1: missing column\(s\) num_gpu"):
        load_trace(str(path))
    empty = write(tmp_path / "empty.csv", "")
    with pytest.raises(TraceError, match="empty file"):
        load_trace(str(empty))


def test_skip_bad_rows_counts_every_kind(tmp_path: Path) -> None:
    path = write(
        tmp_path / "jobs.csv",
        GENERIC_HEADER
        + "a,0,60,1,,,,,\n"
        + "b,x,60,1,,,,,\n"
        + "c,0,60,1,,,,K80,\n"
        + "\n"  # blank lines are not rows
        + "a,5,60,1,,,,,\n"
        + "d,9,60,1,,,,,\n",
    )
    trace = load_generic_csv(path, skip_bad_rows=True)
    assert [j.job_id for j in trace.jobs] == ["a", "d"]
    assert trace.skipped == 3


# ---------------------------------------------------------------- clusters


def test_gang_shape_table() -> None:
    cases = {
        (1, 8): (1, 1),
        (8, 8): (1, 8),
        (16, 8): (2, 8),
        (12, 8): (2, 6),
        (24, 8): (3, 8),
        (13, 8): (13, 1),
        (128, 8): (16, 8),
        (8, 4): (2, 4),
        (6, 4): (2, 3),
        (3, 2): (3, 1),
    }
    for (gpus, per_node), expected in cases.items():
        assert gang_shape(gpus, per_node) == expected, (gpus, per_node)
    assert gang_shape(8, 8, pooled=True) == (8, 1)


def test_parse_cluster_spec_forms() -> None:
    pooled = parse_cluster_spec("pooled:100")
    assert [(n.name, n.gpus, n.gpu_model) for n in pooled.nodes] == [
        ("pool-0", 64, "POOL-GPU"),
        ("pool-1", 36, "POOL-GPU"),
    ]
    assert all(n.labels == {"mlwe.pooled": "true"} for n in pooled.nodes)
    nodes = parse_cluster_spec("nodes:12x8")
    assert len(nodes.nodes) == 12 and nodes.nodes[0].name == "trace-gpu-00"
    assert {(n.gpus, n.gpu_model) for n in nodes.nodes} == {(8, "TRACE-GPU")}
    t4 = parse_cluster_spec("nodes:2x4:T4")
    assert [(n.name, n.gpus, n.gpu_model, n.cpu, n.memory) for n in t4.nodes] == [
        ("t4-0", 4, "T4", 64_000, 524_288),
        ("t4-1", 4, "T4", 64_000, 524_288),
    ]


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("cluster.yaml", "looks like a file.*loaded by the CLI"),
        ("clusters/big", "looks like a file"),
        ("nodes:0x8", "at least 1 node"),
        ("nodes:2x65", "GPUs per node must be 1..64"),
        ("nodes:2x8:K80", "unknown GPU model 'K80'"),
        ("nodes:2by8", "malformed"),
        ("pooled:0", "at least 1 GPU"),
        ("pooled:many", "malformed"),
        ("big", "is not 'pooled:N'"),
    ],
)
def test_parse_cluster_spec_errors(text: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_cluster_spec(text)


def test_pooled_override_splits_jobs_into_one_gpu_replicas() -> None:
    trace = load_trace("itp:04", limit=500, cluster="pooled:256")
    assert trace.pooled
    assert cluster_gpus(trace) == 256
    first = trace.jobs[0]  # 16 GPUs -> 16 replicas of 1 GPU, 4 cores and 32 GiB each
    assert shape(first) == (16, 1000, 4000, 32_768)
    assert all(j.spec.resources.gpu == 1000 for j in trace.jobs)
    note_with(trace, "pooled: no node boundaries")


def test_pooled_override_drops_model_constraints() -> None:
    trace = synthetic_trace(200, seed=1, cluster="pooled:64")
    assert all(j.spec.gpu_models == () for j in trace.jobs)
    note_with(trace, "GPU model constraints dropped")


def test_nodes_override_reshapes_gangs() -> None:
    trace = load_trace("itp:4", limit=50, cluster="nodes:10x4")
    j = trace.jobs[0]  # 16 GPUs
    assert shape(j) == (4, 4000, 16_000, 131_072)
    assert {n.gpu_model for n in trace.cluster.nodes} == {"ITP-GPU"}
    note_with(trace, "cluster given by the caller ('nodes:10x4')")


def test_override_notes_jobs_that_can_never_start() -> None:
    trace = synthetic_trace(300, seed=2, cluster="nodes:4x8:T4")
    note_with(trace, "accept only GPU models the given cluster lacks")


@pytest.mark.parametrize("name", ["philly", "itp:03", "alibaba", "synthetic", "pooled"])
def test_jobs_submit_to_the_trace_cluster(philly: Trace, name: str) -> None:
    if name == "philly":
        trace = philly
    elif name == "pooled":
        trace = load_trace("itp:04", limit=300, cluster="pooled:128")
    else:
        trace = load_trace(name, limit=300)
    cp = build_control_plane(trace.cluster, ManualClock(), catalog=trace.catalog)
    result = cp.apply([Submit(j.spec) for j in trace.jobs[:300]], cause_id="test")
    assert result.accepted, result.reasons()


# ---------------------------------------------------------------- synthetic


def test_synthetic_is_deterministic_per_seed() -> None:
    a, b = synthetic_trace(300, seed=7), synthetic_trace(300, seed=7)
    assert a.jobs == b.jobs and a.notes == b.notes
    c = synthetic_trace(300, seed=8)
    assert [j.duration for j in a.jobs] != [j.duration for j in c.jobs]
    assert load_trace("synthetic", seed=7, limit=300).jobs == a.jobs


def test_synthetic_mix_and_honest_estimates() -> None:
    trace = synthetic_trace(1_000, seed=3)
    assert len(trace.jobs) == 1_000
    assert_sorted_from_zero(trace)
    kinds = {j.spec.kind for j in trace.jobs}
    assert kinds == {
        "fine-tune",
        "batch-embedding",
        "data-processing",
        "inference",
        "training",
        "other",
    }
    for j in trace.jobs:
        est = j.spec.estimated_duration
        assert est is not None and 0.8 * j.duration <= est <= 1.5 * j.duration
        mix = j.spec.labels["mix"]
        if mix == "fine-tune":
            assert j.spec.replicas * j.spec.resources.gpu == 8000
            assert j.spec.gpu_models == ("A100-80GB", "H100-80GB")
            assert j.spec.priority in (100, 500)
            assert j.spec.deadline is not None
            assert est * 1.2 <= j.spec.deadline - j.submit_time <= est * 2.0
            assert (
                j.spec.checkpoint_interval is not None and 900 <= j.spec.checkpoint_interval <= 1800
            )
        elif mix == "inference":
            assert j.spec.protected and j.spec.gpu_models == ("T4", "L4")
        elif mix == "training":
            assert j.spec.replicas in (2, 3, 4) and j.spec.resources.gpu == 8000
        elif mix in ("data-processing", "cpu"):
            assert j.spec.resources.gpu == 0
        else:
            assert mix == "batch-embedding" and j.spec.resources.gpu in (1000, 2000, 4000)


def test_synthetic_cluster_shape() -> None:
    cluster = synthetic_cluster(a100=2, h100=1, t4=3, cpu=0)
    assert [(p.prefix, p.count, p.gpu_model, p.gpus) for p in cluster.pools] == [
        ("a100", 2, "A100-80GB", 8),
        ("h100", 1, "H100-80GB", 8),
        ("t4", 3, "T4", 4),
    ]
    assert len(cluster.all_nodes()) == 6
    with pytest.raises(ValueError, match="unknown mix kind"):
        synthetic_trace(10, mix={"quantum": 1.0})


def test_trace_catalog_extends_the_default() -> None:
    for name in ("PHILLY-GPU", "ITP-GPU", "TRACE-GPU", "POOL-GPU", "G2", "G3", "A100-80GB"):
        assert name in TRACE_CATALOG


def test_jitter_submits_moves_arrivals_later_by_at_most_the_jitter() -> None:
    base = synthetic_trace(n_jobs=200, seed=3)
    moved = jitter_submits(base, 1.0, seed=7)
    assert moved.name == f"{base.name}~jitter1s#7"
    assert moved.cluster is base.cluster and moved.catalog is base.catalog
    before = {j.job_id: j for j in base.jobs}
    assert sorted(before) == sorted(j.job_id for j in moved.jobs)
    for j in moved.jobs:
        old = before[j.job_id]
        assert 0.0 <= j.submit_time - old.submit_time < 1.0
        assert (j.spec, j.duration, j.line) == (old.spec, old.duration, old.line)
    times = [j.submit_time for j in moved.jobs]
    assert times == sorted(times)


def test_jitter_submits_is_seeded_and_zero_is_the_trace_itself() -> None:
    base = synthetic_trace(n_jobs=100, seed=3)
    assert jitter_submits(base, 0.0, seed=1) is base
    a, b, c = (jitter_submits(base, 5.0, seed=s) for s in (1, 1, 2))
    assert [j.submit_time for j in a.jobs] == [j.submit_time for j in b.jobs]
    assert [j.submit_time for j in a.jobs] != [j.submit_time for j in c.jobs]


@pytest.mark.parametrize("bad", [-1.0, float("nan"), float("inf")])
def test_jitter_submits_refuses_a_jitter_that_is_not_finite_and_non_negative(bad: float) -> None:
    with pytest.raises(ValueError, match="jitter seconds must be finite and >= 0"):
        jitter_submits(synthetic_trace(n_jobs=10, seed=3), bad, seed=1)
