"""Real backends behind the core's Backend protocol (:mod:`mlwe.core.backend`).

- :mod:`mlwe.backends.local`: a workload daemon on each machine running real
  processes, and the engine-side ``LocalBackend`` it registers with;
- :mod:`mlwe.backends.ray`: a Ray cluster.

This package imports nothing on its own: each backend pulls in its
dependencies (psutil, NVML, Ray) only when it is used.
"""
