"""The Slurm backend: what is Slurm's own, beyond the conformance suite.

Parsing and job-shaping tables run everywhere. The rest runs on the shared
real Slurm cluster of :mod:`tests.backends.slurm_cluster` (slurmctld and three
slurmd on this machine: n0 and n1 with two fake T4s each, n2 CPU-only):
shaped gangs become ``--ntasks-per-node`` jobs, uneven gangs heterogeneous
jobs, GPUs ``--gres``; the force path; adoption after an engine restart;
discovery of the cluster from Slurm's node table.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mlwe.backends.slurm.backend import (
    SlurmBackendConfig,
    comment_of,
    gpu_model_of,
    job_components,
    parse_comment,
)
from mlwe.backends.slurm.commands import (
    job_record,
    node_record,
    node_record_text,
    parse_gres,
)
from mlwe.core import NodeSpec, State, WorkloadSpec
from tests.backends.slurm_harness import SlurmHarness

SYNTH = [sys.executable, "-m", "mlwe.programs.synthetic", "--memory", "8Mi",
         "--phases", "0.3:1", "--report-every", "0.1"]


# ============================================================ parsing tables
@pytest.mark.parametrize(("gres", "expected"), [
    ("gpu:t4:2", {"t4": 2}),
    ("gpu:t4:2(S:0-1),gpu:a100:1(S:0)", {"t4": 2, "a100": 1}),
    ("gpu:4", {"": 4}),
    ("(null)", {}),
    ("", {}),
    ("shard:8,gpu:a10:1", {"a10": 1}),
])
def test_parse_gres(gres: str, expected: dict[str, int]) -> None:
    assert parse_gres(gres) == expected


def test_node_record_from_22_05_json() -> None:
    rec = node_record({"name": "n0", "state": "mixed", "state_flags": ["DRAIN"], "cpus": 4,
                       "real_memory": 4096, "gres": "gpu:t4:2", "alloc_cpus": 2,
                       "alloc_memory": 100, "free_memory": 1500, "cpu_load": 315,
                       "reason": "maint", "partitions": ["mlwe"]})
    assert (rec.name, rec.cpus, rec.memory_mib, dict(rec.gpus)) == ("n0", 4, 4096, {"t4": 2})
    assert rec.flags == {"MIXED", "DRAIN"}
    assert not rec.down
    assert rec.cpu_load == 3.15
    assert rec.describe() == "DRAIN+MIXED (maint)"


def test_node_record_from_23_02_json() -> None:
    rec = node_record({"name": "n1", "state": ["IDLE", "NOT_RESPONDING"], "cpus": 8,
                       "real_memory": 1024, "gres": "", "free_memory": {"set": True,
                                                                        "number": 512}})
    assert rec.down
    assert rec.free_memory_mib == 512


def test_node_record_from_text() -> None:
    line = ("NodeName=n2 Arch=x86_64 CoresPerSocket=1  CPUAlloc=1 CPUEfctv=4 CPUTot=4"
            " CPULoad=0.50 Gres=gpu:t4:2 NodeAddr=127.0.0.1 RealMemory=4096 AllocMem=64"
            " FreeMem=N/A State=DOWN+NOT_RESPONDING Partitions=mlwe,gpu"
            " Reason=Not responding [slurm@2026-12-01T09:00:00]")
    rec = node_record_text(line)
    assert (rec.name, rec.cpus, rec.memory_mib, rec.alloc_cpus) == ("n2", 4, 4096, 1)
    assert rec.down and rec.flags == {"DOWN", "NOT_RESPONDING"}
    assert rec.reason == "Not responding"
    assert rec.partitions == ("mlwe", "gpu")
    assert rec.free_memory_mib is None


@pytest.mark.parametrize(("raw", "state", "terminal", "leader"), [
    ({"job_id": 7, "job_state": "RUNNING", "het_job_id": 0}, "RUNNING", False, 7),
    ({"job_id": 8, "job_state": "COMPLETING"}, "COMPLETING", False, 8),
    ({"job_id": 9, "job_state": "CANCELLED", "het_job_id": 8}, "CANCELLED", True, 8),
    ({"job_id": 10, "job_state": ["COMPLETED"], "exit_code": {"return_code": 3}},
     "COMPLETED", True, 10),
    ({"job_id": 11, "job_state": ["CANCELLED", "COMPLETING"]}, "COMPLETING", False, 11),
])
def test_job_record(raw: dict[str, Any], state: str, terminal: bool, leader: int) -> None:
    rec = job_record(raw)
    assert (rec.state, rec.terminal, rec.leader) == (state, terminal, leader)


def test_comment_round_trip_and_foreign_comments() -> None:
    c = comment_of("eng-1", "w.1", 3, Path("/shared/run/w.1/a3"))
    assert parse_comment(c, "eng-1") == ("w.1", 3, Path("/shared/run/w.1/a3"))
    assert parse_comment(c, "eng-2") is None  # another engine's job
    assert parse_comment("a user's comment", "eng-1") is None
    assert parse_comment('{"mlwe": "eng-1"}', "eng-1") is None


@pytest.mark.parametrize(("placement", "gpus", "expected"), [
    ([("n0", 0), ("n1", 1)], 0,
     [["--nodelist=n0,n1", "--nodes=2", "--ntasks-per-node=1", "--cpus-per-task=2",
       "--mem=128M"]]),
    ([("n0", 0), ("n0", 1), ("n1", 2), ("n1", 3)], 1,
     [["--nodelist=n0,n1", "--nodes=2", "--ntasks-per-node=2", "--cpus-per-task=2",
       "--mem=256M", "--gres=gpu:t4:2"]]),
    # uneven: a heterogeneous job, one component per group of alike nodes
    ([("n0", 0), ("n0", 1), ("n1", 2)], 0,
     [["--nodelist=n0", "--nodes=1", "--ntasks-per-node=2", "--cpus-per-task=2", "--mem=256M"],
      ["--nodelist=n1", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2",
       "--mem=128M"]]),
    # the same count but another GRES type: another component
    ([("n0", 0), ("n2", 1)], 2,
     [["--nodelist=n0", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2",
       "--mem=128M", "--gres=gpu:t4:2"],
      ["--nodelist=n2", "--nodes=1", "--ntasks-per-node=1", "--cpus-per-task=2",
       "--mem=128M", "--gres=gpu:2"]]),
])
def test_job_components(placement: list[tuple[str, int]], gpus: int,
                        expected: list[list[str]]) -> None:
    types = {"n0": "t4", "n1": "t4", "n2": ""}
    assert job_components(placement, gpus, 2, 128, types.__getitem__) == expected


@pytest.mark.parametrize(("gres", "model"), [
    ("t4", "T4"), ("T4", "T4"), ("a100_80gb", "A100-80GB"), ("a100", "A100-80GB"),
    ("quantum", None),
])
def test_gpu_model_of(gres: str, model: str | None) -> None:
    assert gpu_model_of(gres) == model


@pytest.mark.parametrize(("kw", "error"), [
    ({"prefix": ""}, "prefix"),
    ({"prefix": "a:b"}, "prefix"),
    ({"tick_s": 0}, "tick_s must be a positive"),
    ({"squeue_fast_s": float("nan")}, "squeue_fast_s"),
    ({"default_grace_s": -1}, "default_grace_s must not be negative"),
])
def test_config_refuses_bad_values(kw: dict[str, Any], error: str) -> None:
    with pytest.raises(ValueError, match=error):
        SlurmBackendConfig(**kw)


class FakeSlurm:
    """A stand-in for Slurm's commands (named as such): a node table the test sets, no jobs."""

    node_source = "fake"

    def __init__(self) -> None:
        self.flags = {"n0": frozenset({"IDLE"})}

    def nodes(self) -> list[Any]:
        from mlwe.backends.slurm.commands import SlurmNodeInfo

        return [SlurmNodeInfo(n, f, cpus=4, memory_mib=4096) for n, f in self.flags.items()]

    def jobs(self) -> list[Any]:
        return []


def test_not_responding_is_a_loss_only_once_it_lasts(tmp_path: Path) -> None:
    from mlwe.backends.slurm import SlurmBackend
    from mlwe.core import ClusterSpec
    from mlwe.core.backend import NodeDown, NodeUp

    fake = FakeSlurm()
    cfg = SlurmBackendConfig(run_dir=str(tmp_path), node_period_s=0.02, not_responding_s=3600)
    b = SlurmBackend(ClusterSpec(nodes=(NodeSpec(name="n0", cpu="1", memory="1Gi"),)), cfg,
                     commands=fake)  # type: ignore[arg-type]
    seen: list[Any] = []

    def until(pred: Any, what: str) -> None:
        end = time.monotonic() + 30
        while not pred():
            assert time.monotonic() < end, f"timed out waiting for {what}: {seen}"
            b.wait(0.05)
            seen.extend(e.fact for e in b.poll())

    try:
        fake.flags["n0"] = frozenset({"IDLE", "NOT_RESPONDING"})
        until(lambda: "n0" in b._not_responding, "the flag to be seen")
        seen.extend(e.fact for e in b.poll())
        assert not any(isinstance(f, NodeDown) for f in seen)  # a missed ping is no loss
        b.config.not_responding_s = 0.0  # it has lasted long enough now
        until(lambda: any(isinstance(f, NodeDown) for f in seen), "NodeDown")
        fake.flags["n0"] = frozenset({"IDLE"})
        until(lambda: any(isinstance(f, NodeUp) for f in seen), "NodeUp")
        b.config.not_responding_s = 3600
        fake.flags["n0"] = frozenset({"DOWN", "NOT_RESPONDING"})  # Slurm's own verdict: at once
        until(lambda: sum(isinstance(f, NodeDown) for f in seen) == 2, "the second NodeDown")
        assert [type(f).__name__ for f in seen] == ["NodeDown", "NodeUp", "NodeDown"]
    finally:
        b.close()


# ============================================================== real Slurm
@pytest.fixture
def h(tmp_path: Path) -> Any:
    harness = SlurmHarness(tmp_path)
    try:
        yield harness
    finally:
        harness.close()


def _spec(wid: str, *, replicas: int = 1, cpu: str = "1", gpu: int = 0,
          command: list[str] | None = None, **kw: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate({
        "id": wid, "name": wid, "replicas": replicas, "max_retries": 0,
        "resources": {"cpu": cpu, "memory": "64Mi", **({"gpu": gpu} if gpu else {})},
        "command": command or [*SYNTH, "--work", "0.6"], **kw,
    })


def _job(h: SlurmHarness, wid: str) -> dict[str, Any]:
    info = h.slurm_backend.attempt_info(wid, 1)
    assert info is not None and info["job_id"] is not None
    out = h.slurm._run(["scontrol", "-o", "show", "job", str(info["job_id"])]).stdout.decode()
    return {"info": info, "scontrol": out}


def _nodes(n: int, **kw: Any) -> list[NodeSpec]:
    return [NodeSpec(name=f"n{i}", cpu="4", memory="2Gi", **kw) for i in range(n)]


def test_shaped_gang_is_one_job_with_tasks_per_node(h: SlurmHarness) -> None:
    h.start(_nodes(2))
    h.submit(_spec("mpi", replicas=4, gang={"tasks_per_node": 2},
                   command=[*SYNTH, "--work", "1.5"]))
    h.run_until(lambda: h.state("mpi") is State.RUNNING, timeout=60, what="mpi to run")
    job = _job(h, "mpi")
    assert "NumNodes=2" in job["scontrol"] and "NumTasks=4" in job["scontrol"]
    assert "NodeList=n[0-1]" in job["scontrol"]
    h.run_until(lambda: h.state("mpi") is State.SUCCEEDED, timeout=60, what="mpi to finish")
    (start,) = h.starts("mpi")
    assert sorted(a.node for a in start.placement) == ["n0", "n0", "n1", "n1"]
    assert h.replicas_seen("mpi") == {0, 1, 2, 3}
    assert h.rejected() == []


def test_uneven_gang_is_a_heterogeneous_job(h: SlurmHarness) -> None:
    # n0 has room for two 2-CPU replicas, n1 (busy with a filler) for one
    h.start(_nodes(2))
    h.submit(_spec("filler", cpu="2", command=[*SYNTH, "--work", "30"]))
    h.run_until(lambda: h.state("filler") is State.RUNNING, timeout=60, what="filler to run")
    (fstart,) = h.starts("filler")
    h.submit(_spec("gang", replicas=3, cpu="2"))
    h.run_until(lambda: h.state("gang") is State.SUCCEEDED, timeout=60, what="gang to finish")
    (start,) = h.starts("gang")
    counts: dict[str, int] = {}
    for a in start.placement:
        counts[a.node] = counts.get(a.node, 0) + 1
    assert sorted(counts.values()) == [1, 2]
    assert counts.get(fstart.placement[0].node) == 1
    info = h.slurm_backend.attempt_info("gang", 1)
    assert info is not None and len(info["slurm_states"]) == 2  # two components, one job
    assert set(info["slurm_states"]) == {"COMPLETED"}
    assert h.replicas_seen("gang") == {0, 1, 2}


def test_gpus_are_gres_and_each_replica_gets_its_own(h: SlurmHarness) -> None:
    h.start(_nodes(1, gpus=2, gpu_model="T4"))
    show = ("import os; from mlwe import workload as mw;"
            " d = os.environ['CUDA_VISIBLE_DEVICES'];"
            " mw.report(progress=1.0, gpu=float(d), count=float(len(d.split(','))))")
    h.submit(_spec("g", replicas=2, gpu=1, command=[sys.executable, "-c", show]))
    h.run_until(lambda: h.state("g") is State.SUCCEEDED, timeout=60, what="g to finish")
    assert "TresPerNode=gres:gpu:t4:2" in _job(h, "g")["scontrol"]
    seen = {int(t.metrics["replica"]): t.metrics["gpu"] for t in h.metrics("g")
            if "gpu" in t.metrics}
    assert sorted(seen.values()) == [0.0, 1.0]  # one device each, not the same one
    assert all(t.metrics["count"] == 1.0 for t in h.metrics("g") if "count" in t.metrics)


def test_a_broken_gang_ends_whole(h: SlurmHarness) -> None:
    """Replica 1 fails at once; replica 0 would run a minute: the job is ended, the
    attempt fails with replica 1's code, nothing keeps running."""
    prog = ("import os, sys, time; from mlwe import workload as mw;"
            " mw.report(progress=0.0); time.sleep(0.5);"
            " sys.exit(3) if os.environ['MLWE_REPLICA'] == '1' else time.sleep(60)")
    h.start(_nodes(2))
    h.submit(_spec("broken", replicas=2, command=[sys.executable, "-c", prog]))
    t0 = time.monotonic()
    h.run_until(lambda: h.state("broken") is State.FAILED, timeout=45, what="broken to fail")
    assert time.monotonic() - t0 < 45
    w = h.cp.get("broken")
    assert (w.exit_code, w.failure_cause) == (3, "error")
    info = h.slurm_backend.attempt_info("broken", 1)
    assert info is not None and all(s in ("FAILED", "CANCELLED") for s in info["slurm_states"])


def test_stop_forces_a_program_that_ignores_sigterm(h: SlurmHarness) -> None:
    from mlwe.core.actions import Cancel

    h.start(_nodes(1))
    h.submit(_spec("stubborn", command=[*SYNTH, "--work", "60", "--mode", "ignore-sigterm"]))
    h.run_until(lambda: h.state("stubborn") is State.RUNNING and h.progress("stubborn") > 0,
                timeout=60, what="stubborn to run")
    h.cp.apply([Cancel("stubborn", "test")], cause_id="test")
    h.run_until(lambda: h.state("stubborn") is State.CANCELLED, timeout=60,
                what="stubborn to be cancelled")
    info = h.slurm_backend.attempt_info("stubborn", 1)
    assert info is not None and info["forced"] is True
    assert all(s in ("CANCELLED", "FAILED", "COMPLETED") for s in info["slurm_states"])


def test_engine_restart_adopts_running_jobs(h: SlurmHarness, tmp_path: Path) -> None:
    from mlwe.backends.slurm import SlurmBackend
    from mlwe.core.backend import StopCommand

    h.start(_nodes(1))
    h.submit(_spec("long", command=[*SYNTH, "--work", "60", "--checkpoint-every", "0.2"]))
    h.run_until(lambda: h.state("long") is State.RUNNING and h.progress("long") > 0.01,
                timeout=60, what="long to run")
    old = h.slurm_backend
    job_id = old.attempt_info("long", 1)["job_id"]  # type: ignore[index]
    old.detach()  # the engine goes away; its job keeps running in Slurm
    new = SlurmBackend(old.cluster, old.config, clock=h.clock)
    try:
        running = new.inventory()
        assert [(r.workload, r.attempt, r.nodes) for r in running] == [("long", 1, ("n0",))]
        assert new.attempt_info("long", 1)["job_id"] == job_id  # type: ignore[index]
        new.send([StopCommand("stop-1", "long", 1, grace_s=5.0, reason="orphan")])
        events: list[Any] = []
        end = time.monotonic() + 60
        while time.monotonic() < end and not events:
            new.wait(0.1)
            events += [e for e in new.poll() if type(e.fact).__name__ == "Released"]
        assert events, "no Released from the adopting backend"
        released = events[0].fact
        assert released.checkpointed_progress is not None and released.checkpointed_progress > 0
        states = {j.state for j in new.slurm.jobs() if j.leader == job_id}
        assert states and all(s in ("COMPLETED", "CANCELLED") for s in states), states
    finally:
        new.close()
        h.backend = new  # the harness closes the live one


def test_discover_cluster_from_slurm(h: SlurmHarness) -> None:
    from mlwe.backends.slurm import discover_cluster

    h.start(_nodes(1))
    spec = discover_cluster(h.slurm.commands())
    by = {n.name: n for n in spec.nodes}
    assert set(by) == {"n0", "n1", "n2"}
    assert (by["n0"].gpus, by["n0"].gpu_model, by["n0"].cpu, by["n0"].memory) == (
        2, "T4", 4000, 4096)
    assert (by["n2"].gpus, by["n2"].gpu_model) == (0, None)


def test_a_cluster_spec_slurm_cannot_serve_is_refused(tmp_path: Path) -> None:
    from mlwe.backends.slurm import SlurmBackend
    from mlwe.core import ClusterSpec
    from tests.backends.slurm_cluster import slurm_cluster

    cl = slurm_cluster()
    cfg = SlurmBackendConfig(slurm_conf=str(cl.conf), run_dir=str(tmp_path))
    bad = ClusterSpec(nodes=(NodeSpec(name="n0", cpu="64", memory="1Gi"),
                             NodeSpec(name="nowhere", cpu="1", memory="1Gi"),
                             NodeSpec(name="n2", gpus=1, gpu_model="T4", cpu="1",
                                      memory="1Gi")))
    with pytest.raises(ValueError) as exc:
        SlurmBackend(bad, cfg)
    text = str(exc.value)
    assert "node n0: declares 64000m CPU, Slurm has 4" in text
    assert "node nowhere is not a Slurm node" in text
    assert "node n2: declares 1 GPUs, Slurm's GRES has 0" in text
    assert json.dumps(text)  # one readable message


def test_serve_builds_an_engine_over_the_discovered_slurm_cluster(tmp_path: Path) -> None:
    from mlwe.api.serve import build_service
    from tests.backends.slurm_cluster import new_prefix, slurm_cluster

    cl = slurm_cluster()
    svc = build_service(backend="slurm", data_dir=tmp_path / "data", generator=False,
                        agent=False, start_loop=False,
                        slurm={"slurm_conf": str(cl.conf), "prefix": new_prefix("serve"),
                               "partition": None})
    try:
        nodes = {n.name: n for n in svc.engine.cp.capacity.nodes()}
        assert set(nodes) == {"n0", "n1", "n2"}
        assert nodes["n0"].gpu_model == "T4"
        backend = svc.engine.backend
        inner = getattr(backend, "inner", backend)
        assert inner.name == "slurm"
        assert Path(inner.run_dir) == (tmp_path / "data" / "slurm").resolve()
    finally:
        svc.close()
