"""Real backends behind the core's Backend protocol (:mod:`mlwe.core.backend`).

- :mod:`mlwe.backends.local`: a workload daemon on each machine running real
  processes, and the engine-side ``LocalBackend`` it registers with;
- :mod:`mlwe.backends.ray`: a Ray cluster;
- :mod:`mlwe.backends.slurm`: a Slurm cluster;
- :mod:`mlwe.backends.faults`: a wrapper around any backend that injects the
  faults an operator asks for (diverging loss, OOM loops);
- :mod:`mlwe.backends.common`: what the backends share (their default wall
  clock; how the local and Slurm backends emit events and record errors).

The simulated backend is in :mod:`mlwe.sim` (:mod:`mlwe.sim.live` paces it to
a live clock). The commands build any of them by name through
:mod:`mlwe.runtime.backends`.

This package imports nothing on its own: each backend pulls in its
dependencies (psutil, NVML, Ray) only when it is used.
"""
