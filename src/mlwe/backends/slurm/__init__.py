"""The Slurm backend: the control plane decides, an existing Slurm cluster executes.

- :mod:`.commands`: Slurm's commands (sbatch, scancel, squeue, node state) and
  their JSON (or text) output, parsed;
- :mod:`.backend`: :class:`SlurmBackend`, the Backend protocol on Slurm (with
  :mod:`.config`, :mod:`.state`, :mod:`.jobs`, :mod:`.reports` and
  :mod:`.nodes`), and :func:`discover_cluster` (:mod:`.discovery`: a
  ClusterSpec from Slurm's node table);
- :mod:`.task`: what each Slurm task runs (one replica's program, its reports
  to a shared file);
- :mod:`.cluster`: a real Slurm cluster on one machine (munged, slurmctld, one
  slurmd per node) for tests, benchmarks and demos.
"""

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mlwe.backends.slurm.backend import SlurmBackend, SlurmBackendConfig, discover_cluster
    from mlwe.backends.slurm.cluster import LocalSlurmCluster, SlurmNode, slurm_missing
    from mlwe.backends.slurm.commands import SlurmCommands, SlurmError

# imported on first use: a task or actor importing one submodule (e.g. what runs
# inside a job) must not pay for the engine side (pydantic, the core)
_EXPORTS = {
    "SlurmBackend": "mlwe.backends.slurm.backend",
    "SlurmBackendConfig": "mlwe.backends.slurm.backend",
    "discover_cluster": "mlwe.backends.slurm.backend",
    "LocalSlurmCluster": "mlwe.backends.slurm.cluster",
    "SlurmNode": "mlwe.backends.slurm.cluster",
    "slurm_missing": "mlwe.backends.slurm.cluster",
    "SlurmCommands": "mlwe.backends.slurm.commands",
    "SlurmError": "mlwe.backends.slurm.commands",
}

__all__ = [
    "LocalSlurmCluster",
    "SlurmBackend",
    "SlurmBackendConfig",
    "SlurmCommands",
    "SlurmError",
    "SlurmNode",
    "discover_cluster",
    "slurm_missing",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
