"""The Ray backend: the control plane decides placement, a Ray cluster executes it.

- :mod:`.cluster`: how mlwe nodes map to Ray nodes (custom resources) and a
  real multi-node Ray cluster on one machine for tests and demos;
- :mod:`.runner`: what runs inside a Ray actor (one replica's process tree);
- :mod:`.backend`: :class:`RayBackend`, the Backend protocol on Ray.

Ray is imported lazily (only when a backend or cluster is built), so importing
this package costs nothing for users of other backends.
"""

from mlwe.backends.ray.backend import RayBackend, RayBackendConfig, ray_backend_factory
from mlwe.backends.ray.cluster import LocalRayCluster, ray_node_args, ray_start_command

__all__ = [
    "LocalRayCluster",
    "RayBackend",
    "RayBackendConfig",
    "ray_backend_factory",
    "ray_node_args",
    "ray_start_command",
]
