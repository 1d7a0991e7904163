"""The Ray backend: the control plane decides placement, a Ray cluster executes it.

- :mod:`.cluster`: how mlwe nodes map to Ray nodes (custom resources) and a
  real multi-node Ray cluster on one machine for tests and demos;
- :mod:`.runner`: what runs inside a Ray actor (one replica's process tree);
- :mod:`.backend`: :class:`RayBackend`, the Backend protocol on Ray, built of
  :mod:`.config`, :mod:`.state`, :mod:`.pool`, :mod:`.adoption`,
  :mod:`.telemetry`, :mod:`.teardown`, :mod:`.nodes` and :mod:`.lifecycle`.

Ray is imported lazily (only when a backend or cluster is built), so importing
this package costs nothing for users of other backends.
"""


from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what mypy sees; at run time each name loads on first use
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



_HOME = {
    "RayBackend": "mlwe.backends.ray.backend",
    "RayBackendConfig": "mlwe.backends.ray.backend",
    "ray_backend_factory": "mlwe.backends.ray.backend",
    "LocalRayCluster": "mlwe.backends.ray.cluster",
    "ray_node_args": "mlwe.backends.ray.cluster",
    "ray_start_command": "mlwe.backends.ray.cluster",
}


def __getattr__(name: str) -> Any:
    # loaded on first use: ``mlwe --help`` imports the ray CLI, not the backend
    home = _HOME.get(name)
    if home is None:
        raise AttributeError(f"module 'mlwe.backends.ray' has no attribute {name!r}")
    return getattr(import_module(home), name)
