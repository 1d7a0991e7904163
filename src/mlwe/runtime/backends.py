"""The backends an engine can run on, by name: one registry for every command that builds one.

``mlwe serve --backend KIND`` and the pipelines CLI (``mlwe pipeline ... --backend
KIND``, the case studies) build their backend with :func:`make_backend`;
:func:`backend_kinds` lists the names. The kinds are registered explicitly in
:data:`BACKENDS` (DESIGN convention 7), not by import side effects, and each
factory imports its backend only when called, so that a backend's dependencies
(the local daemon and psutil, Ray, Slurm's commands) load only when it is used.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

from mlwe.core.backend import Backend
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec


class UnknownBackend(ValueError):
    """No backend is registered under that name (the message names the known ones)."""


@dataclass(frozen=True)
class BackendOptions:
    """What a backend may be told besides its clock and cluster; each kind reads its own."""

    seed: int = 0
    #: sim: seconds between telemetry samples (None: the simulated backend's default)
    telemetry_s: float | None = None
    #: sim: a workload's run time when its spec gives no estimate
    default_duration_s: float = 600.0
    #: local: one workload daemon per node, with its files under this directory, so
    #: that a node can fail on its own (:class:`mlwe.backends.local.nodes.LocalNodes`);
    #: None: one daemon for the whole cluster
    local_nodes_dir: Path | None = None
    #: ray: the address of the Ray cluster
    ray_address: str | None = None
    #: slurm: :class:`mlwe.backends.slurm.SlurmBackendConfig` fields
    slurm: Mapping[str, Any] | None = None


BackendFactory = Callable[[Clock, ClusterSpec, BackendOptions], Backend]


def _sim(clock: Clock, cluster: ClusterSpec, opts: BackendOptions) -> Backend:
    from mlwe.sim.backend import SimBackendConfig
    from mlwe.sim.live import LiveSimBackend

    cfg = (
        SimBackendConfig(telemetry_interval_s=opts.telemetry_s, eviction_delay_s=2.0, seed=opts.seed)
        if opts.telemetry_s is not None
        else None
    )
    return LiveSimBackend(clock, cfg, default_duration_s=opts.default_duration_s, seed=opts.seed)


def _local(clock: Clock, cluster: ClusterSpec, opts: BackendOptions) -> Backend:
    if opts.local_nodes_dir is not None:
        from mlwe.backends.local.nodes import LocalNodes

        return LocalNodes(cluster, opts.local_nodes_dir, clock)
    from mlwe.backends.local import LocalBackend

    local = LocalBackend(cluster, clock=clock)
    try:
        local.spawn_daemon(cluster.all_nodes(), declared_gpus=True)
        local.wait_for_nodes(timeout=60)
    except BaseException:
        local.close()
        raise
    return local


def _ray(clock: Clock, cluster: ClusterSpec, opts: BackendOptions) -> Backend:
    from mlwe.backends.ray.backend import RayBackend, RayBackendConfig

    return RayBackend(cluster, RayBackendConfig(address=opts.ray_address), clock=clock)


def _slurm(clock: Clock, cluster: ClusterSpec, opts: BackendOptions) -> Backend:
    from mlwe.backends.slurm import SlurmBackend, SlurmBackendConfig

    return SlurmBackend(cluster, SlurmBackendConfig(**dict(opts.slurm or {})), clock=clock)


#: Every backend kind, by the name the commands take (``--backend``).
BACKENDS: Mapping[str, BackendFactory] = MappingProxyType(
    {
        "sim": _sim,  # the simulator, paced to the engine's clock (mlwe.sim.live)
        "local": _local,  # real processes under workload daemons on this machine
        "ray": _ray,  # a Ray cluster
        "slurm": _slurm,  # a Slurm cluster
    }
)


def backend_kinds() -> tuple[str, ...]:
    """The backend names :func:`make_backend` knows, in registration order."""
    return tuple(BACKENDS)


def make_backend(
    kind: str,
    clock: Clock,
    cluster: ClusterSpec,
    *,
    seed: int = 0,
    telemetry_s: float | None = None,
    default_duration_s: float = 600.0,
    local_nodes_dir: Path | None = None,
    ray_address: str | None = None,
    slurm: Mapping[str, Any] | None = None,
) -> Backend:
    """The backend named ``kind`` for ``cluster`` on ``clock`` (``local`` also starts its
    daemons); the keyword options are :class:`BackendOptions`, each read by its kind.
    Raises :class:`UnknownBackend` for a name not in :data:`BACKENDS`."""
    try:
        factory = BACKENDS[kind]
    except KeyError:
        raise UnknownBackend(
            f"unknown backend {kind!r}: known backends are {', '.join(backend_kinds())}"
        ) from None
    opts = BackendOptions(
        seed=seed,
        telemetry_s=telemetry_s,
        default_duration_s=default_duration_s,
        local_nodes_dir=local_nodes_dir,
        ray_address=ray_address,
        slurm=slurm,
    )
    return factory(clock, cluster, opts)
