"""The local backend on real daemons and real processes: what the conformance suite
does not cover (eviction of whole trees, bad input, telemetry, registration,
heartbeats, daemon shutdown, engine restart)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mlwe.backends.local import LocalBackend
from mlwe.backends.local.daemon import DaemonConfigError, check_nodes
from mlwe.backends.local.telemetry import GpuDevice, Nvml, catalog_model
from mlwe.core import ClusterSpec, NodeSpec, NodeStatus, State, WorkloadSpec
from mlwe.core.actions import Released, Started
from mlwe.core.backend import StartCommand, StopCommand, Telemetry
from mlwe.core.capacity import ReplicaAlloc
from mlwe.core.resources import Resources
from tests.backends.harness import GRACE_S, LocalHarness

PY = sys.executable
SYNTH = ["python", "-m", "mlwe.programs.synthetic"]

#: Lists the live (non-zombie) processes whose environment names a workload (and attempt).
SCAN = r"""
import json, os, sys
def scan(wid, attempt=None):
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
            rss = int(open(f"/proc/{pid}/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            continue
        if b"MLWE_WORKLOAD_ID=" + wid.encode() in env and state != "Z" and (
            attempt is None or b"MLWE_ATTEMPT=" + str(attempt).encode() in env
        ):
            out.append([int(pid), rss])
    return out
"""
_ns: dict[str, object] = {}
exec(SCAN, _ns)


def procs_of(wid: str, attempt: int | None = None) -> list[list[int]]:
    return _ns["scan"](wid, attempt)  # type: ignore[operator,no-any-return]


def node(name: str, cpu: str = "1", memory: str = "1Gi", **kw: object) -> NodeSpec:
    return NodeSpec.model_validate({"name": name, "cpu": cpu, "memory": memory, **kw})


def spec(wid: str, command: list[str], **kw: object) -> WorkloadSpec:
    fields: dict[str, object] = {"id": wid, "name": wid, "max_retries": 0,
                                 "resources": {"cpu": "500m", "memory": "64Mi"}}
    fields.update(kw)
    return WorkloadSpec.model_validate({**fields, "command": command})


# ----------------------------------------------------------- declared nodes
class FakeNvml:
    """Stands in for NVML on a machine without GPUs (only the device list is read)."""

    def __init__(self, *memory_mib: int) -> None:
        self.devices = tuple(GpuDevice(i, "NVIDIA H200", m) for i, m in enumerate(memory_mib))


REFUSED = {
    "more CPUs than the machine": (
        [node("n0", cpu="64")], None, None,
        "node n0 declares 64 CPUs but this machine has 2",
    ),
    "more memory than the machine": (
        [node("n0", memory="100Gi")], None, None,
        "node n0 declares 102400 MiB of memory but this machine has 24000 MiB",
    ),
    "GPUs on a machine without any": (
        [node("g0", gpus=2, gpu_model="A100-80GB")], None, None,
        "node(s) g0 (2 GPUs) declare GPUs but this machine has none",
    ),
    "more GPUs than the machine": (
        [node("g0", gpus=4, gpu_model="H200-141GB")], None, FakeNvml(143771, 143771),
        "node g0 declares 4 GPUs (indices [0, 1, 2, 3]) but this machine has 2",
    ),
    "a GPU model bigger than the device": (
        [node("g0", gpus=1, gpu_model="H200-141GB")], None, FakeNvml(81559),
        "node g0 declares H200-141GB (144384 MiB per GPU) but GPU 0 is NVIDIA H200 with 81559 MiB",
    ),
    "two nodes, one GPU": (
        [node("g0", gpus=1, gpu_model="A100-80GB"), node("g1", gpus=1, gpu_model="A100-80GB")],
        None, FakeNvml(143771),
        "node g1 declares 1 GPUs (indices [1]) but this machine has 1",
    ),
    "one GPU given to two nodes": (
        [node("g0", gpus=1, gpu_model="A100-80GB"), node("g1", gpus=1, gpu_model="A100-80GB")],
        {"g0": (0,), "g1": (0,)}, FakeNvml(143771, 143771), "GPU 0 given to both g0 and g1",
    ),
    "the same node twice": (
        [node("n0"), node("n0")], None, None, "node(s) declared twice: n0",
    ),
}


@pytest.mark.parametrize(("nodes", "indices", "nvml", "message"), REFUSED.values(),
                         ids=REFUSED.keys())
def test_a_node_larger_than_the_machine_is_refused(
    nodes: list[NodeSpec], indices: dict[str, tuple[int, ...]] | None, nvml: FakeNvml | None,
    message: str,
) -> None:
    with pytest.raises(DaemonConfigError) as exc:
        check_nodes(nodes, indices, nvml=nvml, declared_gpus=False,  # type: ignore[arg-type]
                    cpus=2, memory_mib=24000)
    assert message in str(exc.value)


def test_nodes_that_fit_are_accepted_and_share_the_machine() -> None:
    configs, source = check_nodes(
        [node("n0", cpu="2", memory="20Gi"), node("n1", cpu="2", memory="20Gi"),
         node("g0", gpus=2, gpu_model="A100-80GB", cpu="1")],
        nvml=None, declared_gpus=True, cpus=2, memory_mib=24000,
    )
    assert [(c.spec.name, c.gpu_indices) for c in configs] == [
        ("n0", ()), ("n1", ()), ("g0", (0, 1))
    ]
    assert source == "declared"
    configs, source = check_nodes(
        [node("g0", gpus=1, gpu_model="A100-80GB"), node("g1", gpus=1, gpu_model="H200-141GB")],
        {"g1": (0,), "g0": (1,)}, nvml=FakeNvml(143771, 143771),  # type: ignore[arg-type]
        declared_gpus=False, cpus=2, memory_mib=24000,
    )
    assert [c.gpu_indices for c in configs] == [(1,), (0,)]
    assert source == "nvml"


DEVICES = [  # (NVML name, MiB NVML reports, the catalogue model it is declared as)
    ("NVIDIA H200", 143771, "H200-141GB"),
    ("NVIDIA A100-SXM4-80GB", 81559, "A100-80GB"),
    ("NVIDIA H100 80GB HBM3", 81559, "H100-80GB"),
    ("NVIDIA A100-PCIE-40GB", 40536, "A100-40GB"),
    ("NVIDIA A10", 23028, "A10"),
    ("NVIDIA L4", 23034, "L4"),
    ("Tesla T4", 15360, "T4"),  # 6 % under the marketed 16 GiB
    ("Tesla V100-SXM2-32GB", 32510, "V100-32GB"),
    ("Tesla P100-PCIE-16GB", 16280, "P100"),
    ("NVIDIA GeForce RTX 4090", 24564, "A10"),  # unnamed in the catalogue: by size
    ("NVIDIA T400", 1871, None),  # smaller than every model
]


@pytest.mark.parametrize(("name", "mib", "model"), DEVICES, ids=[d[0] for d in DEVICES])
def test_a_device_is_declared_as_the_catalogue_model_it_is(name: str, mib: int,
                                                           model: str | None) -> None:
    assert catalog_model(mib, name) == model
    if model is not None:  # and the daemon accepts a node declared so on that device
        configs, source = check_nodes(
            [node("g0", gpus=1, gpu_model=model)], nvml=FakeNvml(mib),  # type: ignore[arg-type]
            declared_gpus=False, cpus=2, memory_mib=24000)
        assert source == "nvml" and configs[0].gpu_indices == (0,)


def test_serve_local_declares_this_machines_gpus() -> None:
    from mlwe.api.serve import local_cluster

    def gpu_nodes(c: ClusterSpec) -> list[tuple[str, int, str | None]]:
        return [(n.name, n.gpus, n.gpu_model) for n in c.all_nodes() if n.gpus]

    h200 = GpuDevice(0, "NVIDIA H200", 143771)
    assert gpu_nodes(local_cluster([h200])) == [("local-gpu-0", 1, "H200-141GB")]
    t4s = [GpuDevice(i, "Tesla T4", 15360) for i in range(4)]
    cluster = local_cluster(t4s)
    assert gpu_nodes(cluster) == [("local-gpu-0", 4, "T4")]
    check_nodes(list(cluster.all_nodes()), nvml=FakeNvml(*[15360] * 4),  # type: ignore[arg-type]
                declared_gpus=False)
    # no GPU: two T4s as an allocation only (labelled declared); too small a GPU: none
    assert gpu_nodes(local_cluster([])) == [("local-gpu-0", 2, "T4")]
    assert gpu_nodes(local_cluster([GpuDevice(0, "NVIDIA T400", 1871)])) == []
    assert "local-cpu-0" in {n.name for n in local_cluster([]).all_nodes()}


def test_the_daemon_command_refuses_an_oversized_node_with_a_clear_error() -> None:
    r = subprocess.run(
        [PY, "-m", "mlwe.backends.local", "--engine", "127.0.0.1:9", "--node",
         "name=n0,cpu=4096,memory=1Gi"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert "node n0 declares 4096 CPUs but this machine has" in r.stderr
    r = subprocess.run(
        [PY, "-m", "mlwe.backends.local", "--engine", "nowhere", "--node", "name=n0"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert "'nowhere' is not HOST:PORT" in r.stderr
    r = subprocess.run(
        [PY, "-m", "mlwe.backends.local", "--engine", "127.0.0.1:9", "--node", "name=n0,cpu=x"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert "--node 'name=n0,cpu=x': cpu:" in r.stderr


def test_the_engine_refuses_daemons_that_do_not_match_its_cluster(tmp_path: Path) -> None:
    cluster = ClusterSpec(nodes=(node("n0"),))
    b = LocalBackend(cluster, token="s3cret", work_dir=tmp_path, register_timeout_s=60)
    try:
        cases = {
            "cpu": ([node("n0", cpu="500m")], "node n0 does not match the cluster spec:"
                    " cpu 500 (cluster says 1000)"),
            "unknown": ([node("zz")], "node zz is not in the engine's cluster (known: n0)"),
        }
        for nodes, message in cases.values():
            p = b.spawn_daemon(nodes)
            assert p.wait(60) == 2
            assert any(message in e for e in b.errors), (message, list(b.errors))
        p = b.spawn_daemon([node("n0")], extra_args=["--token", "guess"])
        assert p.wait(60) == 2
        assert any("wrong or missing token" in e for e in b.errors)
        b.spawn_daemon([node("n0")])
        b.wait_for_nodes(timeout=30)
        second = b.spawn_daemon([node("n0")])
        assert second.wait(60) == 2
        assert any("node n0 is already served by daemon" in e for e in b.errors)
    finally:
        b.close()


# --------------------------------------------------------------- bad input
def test_bad_command_or_checkpoint_dir_fails_the_workload_not_the_daemon(h: LocalHarness) -> None:
    h.start([node("n0")])
    (h.tmp / "ckpt").mkdir()
    (h.tmp / "ckpt" / "ckpt").write_text("a file where the checkpoint directory should be")
    h.submit(spec("nope", ["definitely-not-a-command-xyz", "--flag"]),
             spec("ckpt", [*SYNTH, "--work", "0.2"]),
             spec("empty", []))
    done = {State.FAILED, State.SUCCEEDED}
    h.run_until(lambda: all(h.state(w) in done for w in ("nope", "ckpt", "empty")),
                timeout=30, what="the bad workloads to fail")
    nope, ckpt, empty = h.cp.get("nope"), h.cp.get("ckpt"), h.cp.get("empty")
    assert (nope.state, nope.exit_code) == (State.FAILED, 127)
    assert nope.failure_cause == "start-failed: command not found: 'definitely-not-a-command-xyz'"
    assert (ckpt.state, ckpt.exit_code) == (State.FAILED, 125)
    assert ckpt.failure_cause is not None
    assert f"checkpoint directory {h.tmp / 'ckpt' / 'ckpt'} is not writable" in ckpt.failure_cause
    assert (empty.state, empty.exit_code) == (State.FAILED, 127)
    assert "the workload has no command" in (empty.failure_cause or "")
    assert "command not found" in nope.history[-1].reason
    # the daemon is alive and well: the next workload runs
    h.submit(spec("fine", [*SYNTH, "--work", "0.2"]))
    h.run_until(lambda: h.state("fine") is State.SUCCEEDED, timeout=30, what="fine to succeed")
    assert h.rejected() == []


# ----------------------------------------------------------------- eviction
def test_the_preemptor_never_starts_while_the_victim_holds_its_memory(h: LocalHarness) -> None:
    h.start([node("n0")])
    out = h.tmp / "scan.json"
    # the victim: 64 MiB itself plus two children of 32 MiB that ignore SIGTERM, so only
    # the SIGKILL at the end of the grace period frees everything
    h.submit(spec("victim", [*SYNTH, "--work", "60", "--memory", "64Mi", "--children", "2",
                             "--child-memory", "32Mi", "--children-ignore-sigterm",
                             "--checkpoint-delay", "0.2", "--report-every", "0.1"],
                  priority="low", resources={"cpu": "1", "memory": "256Mi"}))
    # the memory is really resident: three processes holding at least 64 + 2 x 32 MiB
    h.run_until(lambda: any(t.metrics.get("processes") == 3 and t.metrics["rss_mib"] >= 128
                            for t in h.metrics("victim")),
                timeout=30, what="the victim's three processes to hold their memory")
    h.submit(spec("preemptor", [PY, "-c", SCAN + "\nopen(os.environ['OUT'], 'w').write("
                                "json.dumps(scan('victim')))"],
                  priority="urgent", resources={"cpu": "1", "memory": "256Mi"},
                  env={"OUT": str(out)}))
    h.run_until(lambda: h.state("preemptor") is State.SUCCEEDED, timeout=30,
                what="the preemptor to run")
    assert json.loads(out.read_text()) == []  # not one victim process alive when it started
    victim = h.cp.get("victim")
    preempting = next(t.time for t in victim.history if t.target is State.PREEMPTING)
    released = next(t.time for t in victim.history if t.target is State.PREEMPTED)
    assert released - preempting >= GRACE_S  # the children outlived SIGTERM: forced at the end
    assert procs_of("victim", 1) == []
    assert h.rejected() == []


def test_a_force_stop_does_not_wait_for_the_grace_period(tmp_path: Path) -> None:
    cluster = ClusterSpec(nodes=(node("n0"),))
    b = LocalBackend(cluster, work_dir=tmp_path, report_s=0.1)
    try:
        b.spawn_daemon(list(cluster.nodes))
        b.wait_for_nodes(timeout=30)
        s = spec("stubborn", [*SYNTH, "--work", "60", "--mode", "ignore-sigterm"])
        alloc = ReplicaAlloc("n0", (), 0, Resources(cpu=500, ram=64))
        b.send([StartCommand("start:stubborn:1", "stubborn", 1, (alloc,), s)])
        events: list[object] = []

        def until(pred: object, timeout: float) -> None:
            end = time.monotonic() + timeout
            while not pred():  # type: ignore[operator]
                assert time.monotonic() < end, events
                b.wait(0.05)
                events.extend(e.fact for e in b.poll())

        until(lambda: Started("stubborn", 1) in events, 30)
        until(lambda: any(t.metrics.get("replica") == 0 for t in b.drain_telemetry()), 30)
        b.send([StopCommand("stop:graceful", "stubborn", 1, grace_s=600, reason="preempt")])
        t0 = time.monotonic()
        while time.monotonic() - t0 < 1.0:
            b.wait(0.05)
            events.extend(e.fact for e in b.poll())
        assert not any(isinstance(e, Released) for e in events)  # it ignores SIGTERM
        assert len(procs_of("stubborn")) == 1
        b.send([StopCommand("stop:graceful", "stubborn", 1, grace_s=0, reason="preempt")])
        b.send([StopCommand("stop:force", "stubborn", 1, grace_s=0, reason="preempt")])
        until(lambda: Released("stubborn", 1) in events, 30)  # far less than the 600 s grace
        assert procs_of("stubborn") == []
    finally:
        b.close()


def test_a_failed_gang_replica_stops_the_others(h: LocalHarness) -> None:
    h.start([node("n0"), node("n1")])
    prog = ("import os, sys, time\n"
            "if os.environ['MLWE_REPLICA'] == '1':\n    time.sleep(0.3); sys.exit(5)\n"
            "time.sleep(120)\n")
    h.submit(spec("gang", [PY, "-c", prog], replicas=2, resources={"cpu": "1", "memory": "64Mi"}))
    h.run_until(lambda: h.state("gang") is State.FAILED, timeout=30, what="the gang to fail")
    w = h.cp.get("gang")
    assert (w.exit_code, w.failure_cause) == (5, "error")
    assert procs_of("gang") == []  # replica 0 was stopped, not left sleeping


# ---------------------------------------------------------------- telemetry
def test_telemetry_measures_the_whole_tree_and_the_node(h: LocalHarness) -> None:
    h.start([node("n0", cpu="2")])
    h.submit(spec("busy", [*SYNTH, "--work", "4", "--memory", "96Mi", "--phases", "0.9:10",
                           "--children", "1", "--child-memory", "32Mi"],
                  resources={"cpu": "1", "memory": "512Mi"}))

    def sampled() -> list[Telemetry]:
        return [t for t in h.metrics("busy") if "cpu_pct" in t.metrics]

    # the whole tree: the program (96 MiB) and its child (32 MiB), resident
    h.run_until(lambda: len(sampled()) >= 3 and any(
        t.metrics["processes"] == 2 and t.metrics["rss_mib"] >= 96 + 32 for t in sampled()),
        timeout=30, what="samples of busy's whole tree")
    last = sampled()[-1]
    assert last.node == "n0"
    # 90 % of a core: on a loaded CI machine it gets less, but never nothing
    assert max(t.metrics["cpu_pct"] for t in sampled()) >= 5
    assert last.declared == ()
    assert not {"gpus", "gpu_util", "vram_used_mib"} & set(last.metrics)
    nodes = h.metrics(None, "n0")
    assert nodes
    m = nodes[-1].metrics
    assert {"host_cpu_pct", "host_mem_used_mib", "host_mem_total_mib", "host_load1",
            "cpu_util", "cpu_pct", "rss_mib", "workloads"} <= set(m)
    assert m["workloads"] == 1
    assert 0 < m["host_mem_used_mib"] <= m["host_mem_total_mib"]
    # what the workload itself reported travels too
    assert any("loss" in t.metrics and "step" in t.metrics for t in h.metrics("busy"))


@pytest.mark.skipif(Nvml.open() is not None, reason="GPUs present: figures are measured")
def test_without_gpus_the_gpu_figures_are_the_declared_allocation(h: LocalHarness) -> None:
    h.declared_gpus = True
    h.start([node("g0", gpus=2, gpu_model="A100-80GB", cpu="2")])
    out = h.tmp / "env.json"
    keys = ["CUDA_VISIBLE_DEVICES", "MLWE_WORKLOAD_ID", "MLWE_ATTEMPT", "MLWE_REPLICA",
            "MLWE_CHECKPOINT_DIR", "MLWE_REPORT_FD", "OMP_NUM_THREADS", "MY_SETTING"]
    prog = (f"import json, os, time\nopen({str(out)!r}, 'w').write(json.dumps("
            f"{{k: os.environ.get(k) for k in {keys!r}}}))\ntime.sleep(1.5)\n")
    h.submit(spec("gpu-job", [PY, "-c", prog],
                  resources={"gpu": 1, "cpu": "1500m", "memory": "64Mi"},
                  env={"MY_SETTING": "yes"}))
    h.run_until(lambda: h.state("gpu-job") is State.SUCCEEDED, timeout=30, what="gpu-job")
    env = json.loads(out.read_text())
    (start,) = h.starts("gpu-job")
    assert env == {
        "CUDA_VISIBLE_DEVICES": ",".join(str(d) for d in start.placement[0].devices),
        "MLWE_WORKLOAD_ID": "gpu-job", "MLWE_ATTEMPT": "1", "MLWE_REPLICA": "0",
        "MLWE_CHECKPOINT_DIR": str(h.tmp / "ckpt" / "gpu-job"),
        "MLWE_REPORT_FD": env["MLWE_REPORT_FD"], "OMP_NUM_THREADS": "2", "MY_SETTING": "yes",
    }
    assert len(start.placement[0].devices) == 1
    mine = [t for t in h.metrics("gpu-job") if "cpu_pct" in t.metrics]
    assert mine
    for t in mine:
        assert t.metrics["gpus"] == 1.0
        assert t.metrics["vram_used_mib"] == 81920.0
        assert set(t.declared) == {"gpus", "vram_used_mib"}
        assert "gpu_util" not in t.metrics and "gpu_power_w" not in t.metrics
    node_samples = h.metrics(None, "g0")
    assert all("gpu_util" not in t.metrics for t in node_samples)
    assert any(t.metrics.get("gpus_allocated") == 1.0 and "vram_used_mib" in t.declared
               for t in node_samples)


@pytest.mark.skipif(Nvml.open() is None, reason="needs a GPU with an NVIDIA driver")
def test_with_gpus_the_figures_come_from_nvml(h: LocalHarness) -> None:
    nv = Nvml.open()
    assert nv is not None
    dev = nv.devices[0]
    model = catalog_model(dev.memory_mib, dev.name)
    assert model is not None, dev
    h.start([node("g0", gpus=1, gpu_model=model)])
    h.submit(spec("gpu-job", [PY, "-c", "import time; time.sleep(2)"],
                  resources={"gpu": 1, "cpu": "500m", "memory": "64Mi"}))
    h.run_until(lambda: h.state("gpu-job") is State.SUCCEEDED, timeout=30, what="gpu-job")
    node_samples = h.metrics(None, "g0")
    assert node_samples
    m = node_samples[-1]
    assert "gpu_util" in m.metrics and "vram_used_mib" in m.metrics
    assert 0.0 <= m.metrics["gpu_util"] <= 1.0
    assert m.declared == ()
    mine = [t for t in h.metrics("gpu-job") if "cpu_pct" in t.metrics]
    assert mine and all(t.declared == () for t in mine)
    assert all("gpu_util" in t.metrics for t in mine)


# ----------------------------------------------------- nodes, heartbeats, restarts
def test_one_daemon_serves_several_nodes_each_with_its_capacity(h: LocalHarness) -> None:
    h.daemon_groups = [["big", "small"]]
    h.start([node("big", cpu="1"), node("small", cpu="500m", memory="512Mi")])
    (d,) = h.local.daemons()
    assert d["nodes"] == ["big", "small"]
    h.submit(spec("wide", [*SYNTH, "--work", "0.5"], resources={"cpu": "1", "memory": "64Mi"}),
             spec("narrow", [*SYNTH, "--work", "0.5"],
                  resources={"cpu": "400m", "memory": "64Mi"}))
    h.run_until(lambda: all(h.state(w) is State.SUCCEEDED for w in ("wide", "narrow")),
                timeout=30, what="both to succeed")
    assert [a.node for a in h.starts("wide")[0].placement] == ["big"]
    assert [a.node for a in h.starts("narrow")[0].placement] == ["small"]


def test_a_silent_daemon_loses_its_node_and_its_stale_work_is_killed(h: LocalHarness) -> None:
    h.start([node("n0")])
    h.submit(h.job("a", work_s=6.0, cpu="1", checkpoint_every=0.3))
    h.run_until(lambda: h.state("a") is State.RUNNING, timeout=30, what="a to run")
    daemon = h.daemons["n0"]
    os.kill(daemon.pid, signal.SIGSTOP)  # hung: no heartbeats, its workload keeps running
    try:
        h.run_until(lambda: h.cp.node_status("n0") is NodeStatus.DOWN, timeout=30,
                    what="n0 to be declared down")
        a = h.cp.get("a")
        assert a.failure_cause == "node-lost" and a.failures == 0
        assert len(procs_of("a", 1)) == 1  # still running on the silent machine
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    # it comes back: the node is up again, the stale attempt is killed, the work reruns
    h.run_until(lambda: h.state("a") is State.SUCCEEDED, timeout=30, what="a to rerun")
    assert h.cp.node_status("n0") is NodeStatus.READY
    assert h.cp.get("a").attempt == 2
    assert procs_of("a") == []
    assert h.rejected() == []


def test_a_daemon_shutting_down_checkpoints_its_work_which_resumes_elsewhere(
    h: LocalHarness,
) -> None:
    h.start([node("n0"), node("n1")])
    h.submit(h.job("a", work_s=2.0, cpu="1"))
    h.run_until(lambda: h.state("a") is State.RUNNING, timeout=30, what="a to run")
    h.run_for(0.8)
    (first,) = h.starts("a")
    where = first.placement[0].node
    h.daemons[where].send_signal(signal.SIGTERM)
    h.run_until(lambda: h.state("a") is State.SUCCEEDED, timeout=30, what="a to finish")
    assert h.daemons[where].wait(10) == 0
    a = h.cp.get("a")
    assert (a.attempt, a.failures, a.failure_cause) == (2, 0, "node-lost")
    assert h.cp.node_status(where) is NodeStatus.DOWN
    resumed = h.resumed_from("a", 2)
    assert resumed is not None and resumed >= 0.3, resumed  # the shutdown checkpoint
    assert h.rejected() == []


def test_after_an_engine_restart_the_running_work_is_adopted(tmp_path: Path) -> None:
    cluster = ClusterSpec(nodes=(node("n0"),))
    first = LocalBackend(cluster, work_dir=tmp_path, heartbeat_s=0.5, missed_heartbeats=6)
    daemon = first.spawn_daemon(list(cluster.nodes))
    second: LocalBackend | None = None
    try:
        first.wait_for_nodes(timeout=30)
        s = spec("long", [*SYNTH, "--work", "60", "--report-every", "0.1"])
        alloc = ReplicaAlloc("n0", (), 0, Resources(cpu=500, ram=64))
        first.send([StartCommand("start:long:1", "long", 1, (alloc,), s)])
        end = time.monotonic() + 30
        while Started("long", 1) not in [e.fact for e in first.poll()]:
            assert time.monotonic() < end
            first.wait(0.05)
        port = first.address.rsplit(":", 1)[1]
        # the engine goes away: its socket closes, the daemon and the workload stay
        first.detach()
        second = LocalBackend(cluster, listen=f"127.0.0.1:{port}", heartbeat_s=0.5,
                              missed_heartbeats=6, register_timeout_s=30)
        assert [(r.workload, r.attempt, r.nodes) for r in second.inventory()] == [
            ("long", 1, ("n0",))
        ]
        second.send([StopCommand("stop:long:1", "long", 1, grace_s=5, reason="orphan")])
        end = time.monotonic() + 30
        facts: list[object] = []
        while not any(isinstance(f, Released) for f in facts):
            assert time.monotonic() < end, facts
            second.wait(0.05)
            facts += [e.fact for e in second.poll()]
        assert procs_of("long") == []
    finally:
        if second is not None:
            second.close()
        daemon.terminate()
        daemon.wait(10)
