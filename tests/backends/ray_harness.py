"""The conformance harness for the Ray backend (registered in ``harness.HARNESSES``).

Real Ray: the shared local multi-node cluster of :mod:`tests.backends.ray_cluster`,
one Ray node per mlwe node; losing a node kills its Ray node (raylet and
workers, and the workloads with them)."""

from __future__ import annotations

import time
from typing import Any

from mlwe.core import ClusterSpec
from mlwe.core.backend import Backend
from tests.backends.harness import Harness, MonotonicClock
from tests.backends.ray_cluster import new_prefix, ray_cluster


class RayHarness(Harness):
    name = "ray"
    real = True

    def _clock(self) -> Any:
        return MonotonicClock()

    def _backend(self, cluster: ClusterSpec) -> Backend:
        from mlwe.backends.ray import RayBackend, RayBackendConfig

        self.ray = ray_cluster(cluster.all_nodes())
        config = RayBackendConfig(
            prefix=new_prefix("conf"),
            checkpoint_root=str(self.tmp / "ckpt"),
            telemetry_period_s=0.2,
            node_check_period_s=0.1,
            close_grace_s=0.0,
            # on a loaded machine a Ray call takes seconds: wait for the last sample, the
            # evidence (replicas that ran, resume points) the scenarios assert
            drain_timeout_s=60.0,
        )
        b = RayBackend(cluster, config, clock=self.clock)
        self.ray_backend = b
        return b

    def _advance(self, deadline: float) -> None:
        time.sleep(max(0.0, min(0.02, deadline - self.clock.now())))

    def lose_node(self, node: str) -> None:
        self.ray.kill_node(node)  # SIGKILL of its raylet: Ray notices by health check
