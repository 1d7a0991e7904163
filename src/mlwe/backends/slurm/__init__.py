"""The Slurm backend: the control plane decides, an existing Slurm cluster executes.

- :mod:`.commands`: Slurm's commands (sbatch, scancel, squeue, node state) and
  their JSON (or text) output, parsed;
- :mod:`.backend`: :class:`SlurmBackend`, the Backend protocol on Slurm, and
  :func:`discover_cluster` (a ClusterSpec from Slurm's node table);
- :mod:`.task`: what each Slurm task runs (one replica's program, its reports
  to a shared file);
- :mod:`.cluster`: a real Slurm cluster on one machine (munged, slurmctld, one
  slurmd per node) for tests, benchmarks and demos.
"""

from mlwe.backends.slurm.backend import SlurmBackend, SlurmBackendConfig, discover_cluster
from mlwe.backends.slurm.cluster import LocalSlurmCluster, SlurmNode, slurm_missing
from mlwe.backends.slurm.commands import SlurmCommands, SlurmError

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
