"""The Ray backend on a real multi-node Ray cluster (one machine, fake GPUs).

The cluster is the shared one of :mod:`tests.backends.ray_cluster`: Ray nodes
``n0`` (2 x A100-80GB) and ``n1`` (2 x T4), Ray only counting the GPUs. The
conformance suite runs the common scenarios on Ray too; these tests pin what
is Ray's own: GPU models and devices mapped onto Ray nodes, gangs that start
whole or not at all, release confirmed from Ray's state, the force path,
idempotent commands, restart adoption, clear errors, telemetry.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from mlwe.core import ClusterSpec, NodeSpec, State, WorkloadSpec
from mlwe.core.actions import Cancel, Exited, Released, Started, Submit
from mlwe.core.backend import Event, NodeDown, StartCommand, StopCommand
from mlwe.core.cluster import build_control_plane
from mlwe.core.reconcile import Reconciler
from mlwe.core.scheduler import Scheduler
from tests.backends.ray_cluster import BASE_NODES, new_prefix, ray_cluster

SYNTH = [sys.executable, "-m", "mlwe.programs.synthetic", "--memory", "8Mi",
         "--phases", "0.3:1", "--report-every", "0.1"]
CLUSTER = ClusterSpec(nodes=BASE_NODES)


class Clock:
    def now(self) -> float:
        return time.monotonic()


@pytest.fixture(scope="module")
def cluster() -> Any:
    return ray_cluster()


def _running(prefix: str, wid: str) -> list[str]:
    """Actors of ``prefix`` (warm ones included) that run a replica of ``wid``."""
    import ray

    out = []
    for name in _named(prefix, warm=True):
        try:
            info = ray.get(ray.get_actor(name).info.remote(), timeout=30)
        except Exception:  # killed meanwhile
            continue
        if info.get("workload") == wid:
            out.append(name)
    return out


def _ray_node_of(name: str) -> str:
    import ray

    (node_id,) = [n["NodeID"] for n in ray.nodes()
                  if n["Alive"] and f"mlwe_node:{name}" in n["Resources"]]
    return str(node_id)


def _named(prefix: str, *, warm: bool = False) -> list[str]:
    """Names of the actors of ``prefix`` on Ray (with ``warm``, the idle warm ones too)."""
    import ray

    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(prefix + ":") and (warm or ":~pool:" not in a["name"]))


class Driver:
    """The engine's loop over a control plane, a reconciler and a RayBackend."""

    def __init__(self, tmp: Path, tag: str, *, grace_s: float = 5.0,
                 cluster: ClusterSpec = CLUSTER, **config: Any) -> None:
        from mlwe.backends.ray import RayBackend, RayBackendConfig

        self.clock = Clock()
        self.cp = build_control_plane(cluster, self.clock)
        self.rec = Reconciler(self.cp, Scheduler(), grace_s=grace_s, retry_base_s=0.2,
                              retry_max_s=1.0)
        self.prefix = new_prefix(tag)
        config.setdefault("telemetry_period_s", 0.2)
        config.setdefault("checkpoint_root", str(tmp / "ckpt"))
        config.setdefault("close_grace_s", 0.0)
        config.setdefault("actor_death_settle_s", 0.5)
        config.setdefault("drain_timeout_s", 60.0)  # a loaded machine: keep the evidence
        self.backend = RayBackend(cluster, RayBackendConfig(prefix=self.prefix, **config),
                                  clock=self.clock)
        self.events: list[Event] = []
        self.sent: list[Any] = []
        self.telemetry: list[Any] = []
        self.on_event: Callable[[Event], None] | None = None

    def submit(self, *specs: WorkloadSpec) -> None:
        res = self.cp.apply([Submit(s) for s in specs], cause_id="test")
        assert res.accepted, res.reasons()

    def step(self) -> None:
        events = self.backend.poll()
        for e in events:
            if self.on_event is not None:
                self.on_event(e)
        self.events += events
        self.rec.handle(events)
        commands = self.rec.step()
        self.sent += commands
        self.backend.send(commands)
        self.telemetry += self.backend.drain_telemetry()
        assert self.cp.validate_state() == []

    def run_until(self, pred: Callable[[], bool], timeout: float = 60.0, what: str = "") -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.step()
            if pred():
                return
            time.sleep(0.02)
        states = {w.id: (w.state.value, w.attempt, w.failure_cause)
                  for w in self.cp.workloads.values()}
        raise AssertionError(f"timed out waiting for {what}: {states}; errors:"
                             f" {self.backend.errors}")

    def state(self, wid: str) -> State:
        return self.cp.get(wid).state

    def facts(self, wid: str) -> list[Any]:
        return [e.fact for e in self.events if getattr(e.fact, "workload", None) == wid]

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def driver(cluster: Any, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Driver]:
    d = Driver(tmp_path, request.node.name[5:25])
    try:
        yield d
    finally:
        d.close()
        assert _named(d.prefix, warm=True) == []  # close leaves nothing running on Ray


def _spec(wid: str, command: list[str], **fields: Any) -> WorkloadSpec:
    return WorkloadSpec.model_validate({"id": wid, "name": wid, "command": command,
                                        "max_retries": 0, **fields})


ENV_DUMP = [sys.executable, "-c",
            "import json, os; json.dump({k: v for k, v in os.environ.items()"
            " if k.startswith(('MLWE_', 'CUDA_', 'OMP_'))},"
            " open(os.path.join(os.environ['MLWE_CHECKPOINT_DIR'], 'env.json'), 'w'))"]


def test_gpu_models_devices_and_environment_follow_the_placement(
    driver: Driver, tmp_path: Path
) -> None:
    from ray.util.placement_group import placement_group_table

    driver.submit(
        _spec("on-t4", ENV_DUMP, gpu_models=["T4"], resources={"gpu": 1, "cpu": 1}),
        _spec("on-a100", ENV_DUMP, gpu_models=["A100-80GB"], resources={"gpu": 2, "cpu": 2}),
    )
    driver.run_until(lambda: all(driver.state(w) is State.SUCCEEDED for w in ("on-t4", "on-a100")),
                     what="both to succeed")
    for wid, node in (("on-t4", "n1"), ("on-a100", "n0")):
        (start,) = [c for c in driver.sent if isinstance(c, StartCommand) and c.workload == wid]
        (alloc,) = start.placement
        assert alloc.node == node
        info = driver.backend.attempt_info(wid, 1)
        assert info is not None and info["outcome"] == "exited" and info["exit_code"] == 0
        (rep,) = info["replicas"]
        assert rep["node"] == node
        assert rep["ray_node_id"] == _ray_node_of(node)  # Ray ran it where we placed it
        env = json.loads((tmp_path / "ckpt" / wid / "env.json").read_text())
        assert env["MLWE_WORKLOAD_ID"] == wid and env["MLWE_ATTEMPT"] == "1"
        assert env["MLWE_REPLICA"] == "0" and env["MLWE_REPLICAS"] == "1"
        assert env["MLWE_NODE"] == node
        assert env["MLWE_CHECKPOINT_DIR"] == str(tmp_path / "ckpt" / wid)
        assert "MLWE_REPORT_FD" in env
        started = [e.fact for e in driver.events
                   if isinstance(e.fact, Started) and e.fact.workload == wid]
        assert len(started) == 1
        pg = placement_group_table()
        (entry,) = [e for e in pg.values() if e["name"] == info["placement_group"]]
        assert entry["state"] == "REMOVED"  # released on Ray once it exited
        gpus = 1.0 if wid == "on-t4" else 2.0
        assert entry["bundles"] == {0: {f"mlwe_node:{node}": 1.0, "GPU": gpus}}
        # the devices the control plane chose, not Ray's own pick
        assert env["CUDA_VISIBLE_DEVICES"] == ",".join(str(d) for d in alloc.devices)
        assert len(alloc.devices) == int(gpus)
        assert env["OMP_NUM_THREADS"] == str(int(gpus))
    assert driver.rec.rejected == []


def test_gang_starts_whole_or_not_at_all(
    driver: Driver, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    import ray

    # something outside mlwe holds n1's GPUs on Ray: the gang's n1 bundle cannot be reserved.
    # Its first answer needs a fresh Ray worker on n1, which a loaded machine may take
    # minutes to start (60 s ran out once with both cores busy). The holder is killed
    # whatever happens: left alive, it keeps n1's GPUs from every later test of the module
    holder = ray.remote(num_gpus=2, resources={"mlwe_node:n1": 1})(_Holder).remote()
    request.addfinalizer(lambda: ray.kill(holder))
    ray.get(holder.ping.remote(), timeout=300)
    # each replica waits at 30 % of its work until released, so that both surely run at
    # once when the test looks, however late either starts on a loaded machine
    gate = tmp_path / "release-gang"
    driver.submit(_spec("gang", [*SYNTH, "--work", "1", "--hold-at", "0.3",
                                 "--hold-file", str(gate)], replicas=2,
                        resources={"gpu": 2, "cpu": 1}))
    driver.run_until(lambda: driver.state("gang") is State.STARTING, what="gang to be started")
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        driver.step()
        time.sleep(0.05)
    # neither replica runs, not even the one whose node (n0) is free
    assert driver.state("gang") is State.STARTING
    assert [f for f in driver.facts("gang") if isinstance(f, Started)] == []
    assert _named(driver.prefix) == []
    info = driver.backend.attempt_info("gang", 1)
    assert info is not None and info["phase"] == "placing"
    ray.kill(holder)

    def both_alive() -> bool:
        info = driver.backend.attempt_info("gang", 1)
        pids = [r["pid"] for r in info["replicas"]] if info else []
        return len(pids) == 2 and all(p and _alive(p) for p in pids)

    # both replicas' programs run at once (each holds at its barrier until the gate opens)
    driver.run_until(both_alive, what="both replicas' programs to run at once")
    assert driver.state("gang") is not State.SUCCEEDED
    gate.touch()
    driver.run_until(lambda: driver.state("gang") is State.SUCCEEDED, what="the gang to finish")
    info = driver.backend.attempt_info("gang", 1)
    assert info is not None
    assert sorted(r["node"] for r in info["replicas"]) == ["n0", "n1"]
    assert {r["ray_node_id"] for r in info["replicas"]} == {_ray_node_of("n0"), _ray_node_of("n1")}


class _Holder:
    def ping(self) -> bool:
        return True


def test_preemptor_starts_only_after_the_victims_processes_are_gone(
    driver: Driver, tmp_path: Path
) -> None:
    # one replica: the replicas of a gang share MLWE_CHECKPOINT_DIR, and the synthetic
    # program's checkpoint files would overwrite each other's. It waits at 30 % of its work
    # until released, so that it surely still runs when its processes are listed and
    # preempted, however late the control plane sees its progress on a loaded machine.
    gate = tmp_path / "release-low"
    driver.submit(_spec("low", [*SYNTH, "--work", "2.5", "--checkpoint-delay", "0.3",
                                "--children", "1", "--hold-at", "0.3",
                                "--hold-file", str(gate)],
                        priority="low", resources={"gpu": 2, "cpu": 1}, estimated_duration=2.5,
                        gpu_models=["A100-80GB"]))
    driver.run_until(lambda: driver.state("low") is State.RUNNING, what="low to run")
    driver.run_until(lambda: (driver.cp.get("low").progress or 0) > 0.1, what="low to progress")
    info = driver.backend.attempt_info("low", 1)
    assert info is not None
    (root,) = [r["pid"] for r in info["replicas"]]
    victim_pids = [root, *(c.pid for c in psutil.Process(root).children(recursive=True))]
    assert len(victim_pids) == 2  # the program and its child
    assert all(psutil.pid_exists(p) for p in victim_pids)
    checked: list[bool] = []

    def on_event(e: Event) -> None:
        if isinstance(e.fact, Started) and e.fact.workload == "urgent":
            checked.append(not any(_alive(p) for p in victim_pids))

    driver.on_event = on_event
    driver.submit(_spec("urgent", [*SYNTH, "--work", "0.5"], priority="urgent",
                        gpu_models=["A100-80GB"], resources={"gpu": 2, "cpu": 1}))
    driver.run_until(lambda: driver.cp.get("low").preemptions == 1, what="low to be preempted")
    gate.touch()
    driver.run_until(lambda: driver.state("low") is State.SUCCEEDED, what="low to finish")
    assert checked == [True]  # at the preemptor's start, no victim process was left
    assert driver.state("urgent") is State.SUCCEEDED
    low = driver.cp.get("low")
    assert low.attempt == 2 and low.preemptions == 1
    (released,) = [f for f in driver.facts("low") if isinstance(f, Released)]
    assert released.checkpointed_progress is not None and released.checkpointed_progress > 0.1
    order = [type(f).__name__ + ":" + f.workload for f in (e.fact for e in driver.events)
             if isinstance(f, Released | Started)]
    assert order.index("Released:low") < order.index("Started:urgent")
    # the second attempt resumed from the checkpoint the first one wrote on SIGTERM
    resumed = [t.metrics["resumed_from"] for t in driver.telemetry
               if t.workload == "low" and t.metrics.get("attempt") == 2.0
               and "resumed_from" in t.metrics]
    assert resumed and resumed[0] == pytest.approx(released.checkpointed_progress, abs=1e-6)
    assert driver.rec.rejected == []


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_program_ignoring_sigterm_is_killed_after_the_grace_and_ray_confirms_it(
    cluster: Any, tmp_path: Path
) -> None:
    from ray.util.state import get_actor

    d = Driver(tmp_path, "force", grace_s=1.0)
    try:
        d.submit(_spec("stubborn", [*SYNTH, "--work", "60", "--mode", "ignore-sigterm"]))
        d.run_until(lambda: d.state("stubborn") is State.RUNNING, what="stubborn to run")
        # it ignores SIGTERM once it runs (before, Python's default action would end it)
        d.run_until(lambda: d.cp.get("stubborn").progress > 0, what="stubborn to report")
        info = d.backend.attempt_info("stubborn", 1)
        assert info is not None
        (pid,) = [r["pid"] for r in info["replicas"]]
        (actor,) = _running(d.prefix, "stubborn")
        import ray

        actor_id = ray.get_actor(actor)._actor_id.hex()
        assert d.cp.apply([Cancel("stubborn")], cause_id="test").accepted
        t0 = time.monotonic()
        d.run_until(lambda: d.state("stubborn") is State.CANCELLED, what="the cancel")
        assert time.monotonic() - t0 >= 1.0  # the grace period was given
        info = d.backend.attempt_info("stubborn", 1)
        assert info is not None and info["forced"] and info["outcome"] == "released"
        assert not _alive(pid)
        api = d.backend._api_url
        assert api is not None  # the test cluster runs the dashboard, so the state API is used
        assert get_actor(actor_id, address=api).state == "DEAD"  # Ray's state API agrees
        assert _running(d.prefix, "stubborn") == []
        (fig,) = d.backend.stop_figures
        assert fig["grace_s"] == 1.0 and fig["forced"] == 1.0
        assert d.rec.rejected == []  # no fact the control plane had to refuse
    finally:
        d.close()


def test_commands_are_idempotent_by_request_id(driver: Driver) -> None:
    driver.submit(_spec("once", [*SYNTH, "--work", "30"]))
    sent: list[Any] = []
    while not sent:
        driver.rec.handle(driver.backend.poll())
        sent = driver.rec.step()
    (start,) = sent
    assert isinstance(start, StartCommand)
    driver.backend.send([start, start])
    driver.backend.send([start])  # again, later
    driver.run_until(lambda: driver.state("once") is State.RUNNING, what="once to run")
    assert len(_running(driver.prefix, "once")) == 1  # one actor, not three
    stop = StopCommand("stop:once:1:test", "once", 1, 0.0, "cancel")
    assert driver.cp.apply([Cancel("once")], cause_id="test").accepted
    driver.backend.send([stop, stop])
    driver.run_until(lambda: driver.state("once") is State.CANCELLED, what="once to stop")
    driver.backend.send([StopCommand("stop:once:1:other", "once", 1, 0.0, "orphan")])
    for _ in range(10):
        driver.step()
    assert len([f for f in driver.facts("once") if isinstance(f, Started)]) == 1
    assert len([f for f in driver.facts("once") if isinstance(f, Released)]) == 1
    assert driver.rec.rejected == []
    # a stop for an attempt Ray never ran: nothing holds resources, released at once
    driver.backend.send([StopCommand("stop:ghost:3:cancel", "ghost", 3, 5.0, "cancel")])
    events = driver.backend.poll()
    assert [e.fact for e in events] == [Released("ghost", 3)]
    ids = [e.event_id for e in driver.events + events]
    assert len(ids) == len(set(ids))  # every event has its own id


@pytest.mark.parametrize(
    ("command", "config", "code", "cause"),
    [
        (["/nonexistent/trainer"], {}, 127, "start-failed: command not found: '/nonexistent/trainer'"),
        ([], {}, 127, "start-failed: the workload has no command to run (spec.command is empty)"),
        (["true"], {"checkpoint_root": "/proc/mlwe"}, 125,
         "start-failed: checkpoint directory /proc/mlwe/bad is not writable"),
    ],
    ids=["command-not-found", "no-command", "checkpoint-dir-not-writable"],
)
def test_a_workload_that_cannot_start_fails_with_a_clear_cause(
    cluster: Any, tmp_path: Path, command: list[str], config: dict[str, Any], code: int, cause: str
) -> None:
    d = Driver(tmp_path, "bad", **config)
    try:
        d.submit(_spec("bad", command))
        d.run_until(lambda: d.state("bad") is State.FAILED, what="bad to fail")
        w = d.cp.get("bad")
        assert w.exit_code == code
        assert w.failure_cause is not None and w.failure_cause.startswith(cause)
        assert [f for f in d.facts("bad") if isinstance(f, Started)] == []
        (exited,) = [f for f in d.facts("bad") if isinstance(f, Exited)]
        assert exited.exit_code == code
    finally:
        d.close()
    assert _named(d.prefix, warm=True) == []


def test_a_cluster_spec_that_ray_does_not_match_is_refused(cluster: Any) -> None:
    from mlwe.backends.ray import RayBackend, RayBackendConfig

    wrong = ClusterSpec(nodes=(NodeSpec(name="n0", gpu_model="A100-80GB", gpus=8),))
    with pytest.raises(ValueError, match="node n0: declares 8 GPUs but its Ray node has 2"):
        RayBackend(wrong, RayBackendConfig(prefix=new_prefix("wrong")))
    model = ClusterSpec(nodes=(NodeSpec(name="n1", gpu_model="H100-80GB", gpus=2),))
    with pytest.raises(ValueError, match="node n1: declares GPU model H100-80GB"):
        RayBackend(model, RayBackendConfig(prefix=new_prefix("model")))
    with pytest.raises(ValueError, match="prefix"):
        RayBackendConfig(prefix="a:b")
    # a node no Ray node serves is down from the first poll
    ghost = ClusterSpec(nodes=(*BASE_NODES, NodeSpec(name="ghost", cpu="1", memory="1Gi")))
    b = RayBackend(ghost, RayBackendConfig(prefix=new_prefix("ghost")))
    try:
        assert [e.fact for e in b.poll()] == [
            NodeDown("ghost", "no Ray node advertises mlwe_node:ghost")]
        assert b.poll() == []
    finally:
        b.close()


def test_a_restarted_engine_adopts_what_runs_and_can_stop_it(
    cluster: Any, tmp_path: Path
) -> None:
    from mlwe.backends.ray import RayBackend, RayBackendConfig
    from mlwe.core.backend import RunningAttempt

    first = Driver(tmp_path, "adopt")
    first.submit(_spec("long", [*SYNTH, "--work", "30"], replicas=2, resources={"gpu": 1}))
    first.run_until(lambda: first.state("long") is State.RUNNING, what="long to run")
    first.run_until(lambda: (first.cp.get("long").progress or 0) > 0.02, what="some progress")
    # the engine dies without closing its backend: the detached actors keep running
    config = RayBackendConfig(prefix=first.prefix, checkpoint_root=str(tmp_path / "ckpt"))
    second = RayBackend(CLUSTER, config, clock=Clock())
    try:
        (running,) = second.inventory()
        assert running.workload == "long" and running.attempt == 1
        assert sorted(running.nodes) == sorted(a.node for a in first.cp.get("long").placement)
        assert isinstance(running, RunningAttempt)
        second.send([StopCommand("stop:long:1:preempt", "long", 1, 5.0, "preempt")])
        end = time.monotonic() + 60
        got: list[Any] = []
        while time.monotonic() < end and not got:
            got = [e.fact for e in second.poll() if isinstance(e.fact, Released)]
            time.sleep(0.02)
        (rel,) = got
        assert rel.workload == "long" and rel.attempt == 1
        assert rel.checkpointed_progress is not None and rel.checkpointed_progress > 0.02
        assert second.inventory() == []
    finally:
        second.close()
        first.close()
    assert _named(first.prefix, warm=True) == []


def test_telemetry_measures_the_process_tree_and_labels_declared_gpus(
    driver: Driver, tmp_path: Path
) -> None:
    # held at half its work (busy as when working) until its telemetry has been seen: a
    # loaded machine may otherwise take no sample of it while it runs
    gate = tmp_path / "release-busy"
    driver.submit(_spec("busy", [*SYNTH, "--work", "1.5", "--memory", "64Mi",
                                 "--phases", "0.9:1", "--hold-at", "0.5",
                                 "--hold-file", str(gate)], resources={"gpu": 1, "cpu": 1},
                        gpu_models=["T4"]))

    def sampled() -> bool:
        mine = [t.metrics for t in driver.telemetry if t.workload == "busy"]
        hosts = [t.metrics for t in driver.telemetry if t.workload is None and t.node == "n1"
                 and t.metrics["workloads"] == 1.0 and "host_mem_total_mib" in t.metrics
                 and t.metrics.get("ray_actors_alive", 0) >= 1.0]
        return bool(hosts) and any(m.get("rss_mib", 0) >= 64 for m in mine) and any(
            m.get("cpu_pct", 0) > 10 for m in mine) and any("loss" in m for m in mine)

    driver.run_until(sampled, what="busy's telemetry while it runs")
    gate.touch()
    driver.run_until(lambda: driver.state("busy") is State.SUCCEEDED, what="busy to finish")
    mine = [t for t in driver.telemetry if t.workload == "busy"]
    assert mine and all(t.node == "n1" for t in mine)
    assert max(t.metrics.get("rss_mib", 0) for t in mine) >= 64  # the 64 MiB it touched
    assert max(t.metrics.get("cpu_pct", 0) for t in mine) > 10
    assert any("loss" in t.metrics for t in mine)
    assert all(t.declared == ("gpus", "vram_used_mib") and t.metrics["gpus"] == 1.0 for t in mine)
    nodes = [t for t in driver.telemetry if t.workload is None and t.node == "n1"]
    assert nodes and all(t.metrics["ray_alive"] == 1.0 for t in nodes)
    assert max(t.metrics["workloads"] for t in nodes) == 1.0
    assert max(t.metrics.get("ray_actors_alive", 0) for t in nodes) >= 1.0  # state API
    # the machine as measured by the actor on that node (psutil), while something ran there
    busy = [t for t in nodes if t.metrics["workloads"] == 1.0 and "host_mem_total_mib" in t.metrics]
    assert busy and busy[-1].metrics["host_mem_total_mib"] == pytest.approx(
        psutil.virtual_memory().total / 2**20)
    # this machine has no GPU driver: nothing measured, the allocation is labelled declared
    assert "gpu_util" not in mine[-1].metrics
    progress = [f.progress for f in driver.facts("busy") if f.__class__.__name__ == "Progress"]
    assert progress and progress == sorted(progress)


def test_a_start_takes_a_warm_runner_and_the_pool_is_refilled(driver: Driver) -> None:
    driver.run_until(lambda: driver.backend.warm_runners("n1") == 1, what="a warm runner on n1")
    driver.submit(_spec("quick", [*SYNTH, "--work", "0.3"], gpu_models=["T4"],
                        resources={"gpu": 1}))
    driver.run_until(lambda: driver.state("quick") is State.SUCCEEDED, what="quick to finish")
    info = driver.backend.attempt_info("quick", 1)
    assert info is not None
    (rep,) = info["replicas"]
    assert rep["node"] == "n1" and ":~pool:n1:" in rep["actor"]  # it took the warm one
    assert rep["ray_node_id"] == _ray_node_of("n1")
    # used once: killed with its attempt, and a new one is started in its place
    assert rep["actor"] not in _named(driver.prefix, warm=True)
    driver.run_until(lambda: driver.backend.warm_runners("n1") == 1, what="the pool refilled")


def test_cli_prints_ray_start_lines_and_checks_a_live_cluster(cluster: Any, tmp_path: Path) -> None:
    import subprocess

    spec = tmp_path / "cluster.yaml"
    spec.write_text(
        "nodes:\n"
        "  - {name: n0, gpu_model: A100-80GB, gpus: 2}\n"
        "  - {name: n1, gpu_model: T4, gpus: 4}\n"  # its Ray node has only 2
        "  - {name: ghost, cpu: 1}\n"
    )
    mlwe = str(Path(sys.executable).parent / "mlwe")
    out = subprocess.run([mlwe, "ray", "commands", str(spec), "--head", "10.1.2.3:6380"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert ("ray start --address=10.1.2.3:6380 --num-gpus=2"
            """ --resources='{"mlwe_node:n0":1000.0,"gpu_model:A100-80GB":2.0}'""") in out.stdout
    out = subprocess.run([mlwe, "ray", "check", str(spec), "--address", cluster.address, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1, out.stderr  # something is missing
    report = json.loads(out.stdout.strip().splitlines()[-1])
    rows = {r["node"]: r for r in report["nodes"]}
    assert report["ok"] is False
    assert rows["n0"]["problems"] == [] and rows["n0"]["ray_node"] == _ray_node_of("n0")
    assert rows["n1"]["problems"] == ["node n1: declares 4 GPUs but its Ray node has 2",
                                      "node n1: declares GPU model T4 but its Ray node does not"
                                      " advertise gpu_model:T4=4"]
    assert rows["ghost"]["problems"] == ["no live Ray node advertises mlwe_node:ghost"]


def test_an_actor_killed_outside_mlwe_fails_the_attempt_and_leaves_no_process(
    driver: Driver,
) -> None:
    import ray

    driver.submit(_spec("victim", [*SYNTH, "--work", "60", "--children", "1"]))
    driver.run_until(lambda: driver.cp.get("victim").progress > 0, what="victim to report")
    info = driver.backend.attempt_info("victim", 1)
    assert info is not None
    (rep,) = info["replicas"]
    root = psutil.Process(rep["pid"])
    tree = [root, *root.children(recursive=True)]
    assert len(tree) == 2
    ray.kill(ray.get_actor(rep["actor"]))  # someone kills the Ray actor, not the program
    driver.run_until(lambda: driver.state("victim") is State.FAILED, what="victim to fail")
    w = driver.cp.get("victim")
    assert w.failure_cause == "error" and w.exit_code == -1 and w.failures == 1
    assert any("actor died" in e for e in driver.backend.errors)
    for p in tree:  # the program died with its actor, its child with the reaper
        assert not _alive(p.pid)


def test_a_program_killed_just_before_its_actor_died_fails_as_the_actor_death(
    driver: Driver,
) -> None:
    # ray.kill makes the Ray worker kill its child programs before it exits, so the
    # actor's wait() can report "killed by SIGKILL" before the actor is seen dead (a
    # loaded machine showed it). That order is made certain here: the program is
    # killed, its wait() result is in, the actor is killed, and only then does the
    # backend look. A signal is the program's own end only if its actor lives on.
    import os
    import signal

    import ray

    driver.submit(_spec("victim", [*SYNTH, "--work", "60"]))
    driver.run_until(lambda: driver.cp.get("victim").progress > 0, what="victim to report")
    info = driver.backend.attempt_info("victim", 1)
    assert info is not None
    (rep,) = info["replicas"]
    (replica,) = driver.backend._attempts[("victim", 1)].replicas
    os.kill(rep["pid"], signal.SIGKILL)
    done, _ = ray.wait([replica.wait_ref], timeout=60)
    assert done, "the actor's wait() did not report its program's end"
    actor = ray.get_actor(rep["actor"])
    ray.kill(actor)
    end = time.monotonic() + 60
    while True:  # until Ray says the actor died (not merely unavailable)
        assert time.monotonic() < end, "Ray did not report the killed actor dead"
        try:
            ray.get(actor.info.remote(), timeout=30)
        except ray.exceptions.ActorUnavailableError:
            continue
        except ray.exceptions.RayActorError:
            break
    driver.run_until(lambda: driver.state("victim") is State.FAILED, what="victim to fail")
    w = driver.cp.get("victim")
    assert w.failure_cause == "error" and w.exit_code == -1, (w.failure_cause, w.exit_code)
    assert any("actor died" in e for e in driver.backend.errors), driver.backend.errors


def test_a_node_loss_the_gcs_has_not_noticed_yet_is_not_blamed_on_the_workload(
    cluster: Any, tmp_path: Path,
) -> None:
    # A node dies: its program is killed a moment before its raylet (a parent-death
    # signal, the kernel's OOM killer on the whole machine), and its actor reports the
    # SIGKILL. The GCS needs several missed health checks (seconds, more on a loaded
    # machine) to say the node died, so the backend must settle the node first: the dead
    # raylet refuses connections, which shows the node is gone before the GCS says so.
    import os
    import signal

    d = Driver(tmp_path, "gcs-late", node_check_period_s=0.1)
    try:
        d.submit(_spec("doomed", [*SYNTH, "--work", "60"], max_retries=3))
        d.run_until(lambda: d.cp.get("doomed").progress > 0, what="doomed to report")
        info = d.backend.attempt_info("doomed", 1)
        assert info is not None
        (rep,) = info["replicas"]
        node = rep["node"]
        os.kill(rep["pid"], signal.SIGKILL)
        cluster.kill_node(node)
        d.run_until(lambda: any(isinstance(e.fact, NodeDown) and e.fact.node == node for e in d.events),
                    what=f"{node} to be reported down")
        d.run_until(lambda: d.cp.get("doomed").attempt >= 2 or d.state("doomed") is State.PENDING,
                    what="doomed to be requeued")
        w = d.cp.get("doomed")
        assert w.failure_cause == "node-lost", (w.failure_cause, d.backend.errors)
        assert w.failures == 0  # a lost node is not the workload's fault
        exited = [f for f in d.facts("doomed") if isinstance(f, Exited)]
        assert all(f.cause == "node-lost" for f in exited), exited
    finally:
        d.close()
