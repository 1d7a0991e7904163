"""Engines for the pipeline tests.

``sim_engine``: the real engine over the live-paced simulated backend on a
manual clock (no processes: the DAG logic, the control plane's verdicts and
the audit, deterministically). ``local_engine``: the real engine over real
workload daemons on this machine (one per node), for steps that run as real
processes and write real files.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from mlwe.backends.local.nodes import LocalNodes
from mlwe.core.clock import ManualClock
from mlwe.core.spec import ClusterSpec, NodeSpec, QueueSpec, ReplicaQuota
from mlwe.pipelines.runner import PipelineRunner
from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine, EngineConfig
from mlwe.sim.live import LiveSimBackend

SIM_CLUSTER = ClusterSpec(
    nodes=(
        NodeSpec(name="gpu-0", gpu_model="A100-80GB", gpus=1, cpu="8", memory="32Gi"),
        NodeSpec(name="cpu-0", cpu="4", memory="16Gi"),
    ),
    queues=(QueueSpec(name="small", nominal=ReplicaQuota(cpu="1")),),
)

LOCAL_CLUSTER = ClusterSpec(nodes=(NodeSpec(name="local-a", cpu="2", memory="2Gi"),))


class SimRig:
    def __init__(self, engine: Engine, runner: PipelineRunner, clock: ManualClock) -> None:
        self.engine, self.runner, self.clock = engine, runner, clock

    def run_for(self, seconds: float, step: float = 1.0) -> None:
        """Advance simulated time, ticking the engine and the runner at every step."""
        t = 0.0
        while t < seconds:
            self.clock.advance(step)
            t += step
            self.engine.tick()
            self.runner.advance()

    def until(self, predicate: Callable[[], bool], limit_s: float = 600.0) -> None:
        t = 0.0
        while not predicate():
            assert t < limit_s, f"condition not met after {limit_s} simulated seconds"
            self.run_for(1.0)
            t += 1.0


@pytest.fixture
def sim(tmp_path: Path) -> Iterator[SimRig]:
    clock = ManualClock(1_000_000.0)
    backend = LiveSimBackend(clock, default_duration_s=10.0)
    engine = Engine.open(SIM_CLUSTER, backend, data_dir=tmp_path, clock=clock,
                         config=EngineConfig(retry_base_s=1.0, grace_s=5.0))
    runner = PipelineRunner(engine, tmp_path, verify_outputs=False)
    yield SimRig(engine, runner, clock)
    engine.close()


@pytest.fixture
def local(tmp_path: Path) -> Iterator[tuple[Engine, PipelineRunner]]:
    clock = WallClock()
    backend = LocalNodes(LOCAL_CLUSTER, tmp_path / "local", clock)
    engine = Engine.open(LOCAL_CLUSTER, backend, data_dir=tmp_path, clock=clock,
                         config=EngineConfig(retry_base_s=0.2, retry_max_s=1.0, grace_s=2.0))
    runner = PipelineRunner(engine, tmp_path)
    yield engine, runner
    engine.close(stop_workloads=True)
