"""The conformance harness for the Slurm backend (registered in ``harness.HARNESSES``).

Real Slurm: the shared local cluster of :mod:`tests.backends.slurm_cluster`
(slurmctld and three slurmd on this machine), one Slurm node per mlwe node;
losing a node SIGKILLs its slurmd, its step daemons and its jobs' processes,
and Slurm notices by its own ping (``SlurmdTimeout``)."""

from __future__ import annotations

from typing import Any

from mlwe.core import ClusterSpec
from mlwe.core.backend import Backend
from tests.backends.harness import Harness, MonotonicClock
from tests.backends.slurm_cluster import new_prefix, slurm_cluster


class SlurmHarness(Harness):
    name = "slurm"
    real = True

    def _clock(self) -> Any:
        return MonotonicClock()

    def _backend(self, cluster: ClusterSpec) -> Backend:
        from mlwe.backends.slurm import SlurmBackend, SlurmBackendConfig

        self.slurm = slurm_cluster([n.name for n in cluster.all_nodes()])
        config = SlurmBackendConfig(
            prefix=new_prefix("conf"), run_dir=str(self.tmp / "slurm-run"),
            checkpoint_root=str(self.tmp / "ckpt"), slurm_conf=str(self.slurm.conf),
            telemetry_period_s=0.5, node_period_s=0.25, squeue_fast_s=0.1,
        )
        b = SlurmBackend(cluster, config, clock=self.clock)
        self.slurm_backend = b
        return b

    def _advance(self, deadline: float) -> None:
        self.slurm_backend.wait(max(0.0, min(0.02, deadline - self.clock.now())))

    def lose_node(self, node: str) -> None:
        self.slurm.kill_node(node)
