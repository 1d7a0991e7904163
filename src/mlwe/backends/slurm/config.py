"""SlurmBackendConfig: how the Slurm backend reaches Slurm and behaves."""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass


@dataclass
class SlurmBackendConfig:
    """How the Slurm backend reaches Slurm and behaves (figures in seconds)."""

    prefix: str = "mlwe"  # this engine's jobs: --comment {"mlwe": prefix, ...}
    partition: str | None = None  # None: the cluster's default partition
    account: str | None = None
    run_dir: str | None = None  # shared by engine and nodes: scripts, reports, logs
    checkpoint_root: str | None = None  # shared; default <run_dir>/checkpoints
    python: str = sys.executable  # the Python (with mlwe) the tasks run under
    slurm_conf: str | None = None  # SLURM_CONF for the commands; None: Slurm's default
    bin_dir: str | None = None  # where sbatch & co live; None: PATH
    command_timeout_s: float = 30.0
    tick_s: float = 0.05  # how often the report files are read
    squeue_fast_s: float = 0.2
    squeue_slow_s: float = 2.0
    node_period_s: float = 1.0
    #: a node Slurm flags NOT_RESPONDING (a missed ping, often a busy slurmd) is lost only
    #: once the flag lasts this long, or when Slurm itself sets it DOWN
    not_responding_s: float = 5.0
    telemetry_period_s: float = 1.0  # the tasks' CPU/RSS samples
    start_timeout_s: float = 300.0  # a job Slurm keeps pending longer fails to start
    stop_margin_s: float = 10.0  # after the force: Slurm must have ended the job by then
    default_grace_s: float = 10.0  # for a SIGTERM that did not come from this engine
    progress_step: float = 0.0  # progress is reported when it moved this much (or checkpointed)
    extra_sbatch: tuple[str, ...] = ()  # e.g. ("--qos=mlwe",)

    def __post_init__(self) -> None:
        if not self.prefix or any(c in self.prefix for c in ':"\\ '):
            raise ValueError(f"prefix {self.prefix!r} must be non-empty, without ':', quotes,"
                             " backslashes or spaces")
        for name in ("tick_s", "squeue_fast_s", "squeue_slow_s", "node_period_s",
                     "telemetry_period_s", "start_timeout_s", "command_timeout_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a positive number of seconds, got {v!r}")
        for name in ("stop_margin_s", "default_grace_s", "progress_step", "not_responding_s"):
            v = getattr(self, name)
            if not (isinstance(v, int | float) and math.isfinite(v) and v >= 0):
                raise ValueError(f"{name} must not be negative, got {v!r}")

