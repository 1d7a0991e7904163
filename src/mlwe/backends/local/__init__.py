"""The local backend: workload daemons running real processes, and the engine's side.

- :class:`LocalBackend` (engine side, :mod:`.backend`): the core Backend protocol
  over daemon connections;
- the daemon (:mod:`.daemon`, ``mlwe daemon``): runs workloads as process trees,
  evicts them gracefully, measures them with psutil and NVML.
"""

from mlwe.backends.local.backend import LocalBackend

__all__ = ["LocalBackend"]
