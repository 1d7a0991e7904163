"""RayBackendConfig: how the Ray backend connects and behaves."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RayBackendConfig:
    """How the Ray backend connects and behaves (every figure in seconds)."""

    #: Ray address ("auto", "HOST:PORT"); "local": start a Ray cluster on this machine with
    #: one Ray node per mlwe node (fake GPUs), owned and shut down by the backend; None: this
    #: process must already be connected (``ray.init``)
    address: str | None = None
    namespace: str = "mlwe"  # Ray namespace used when this backend connects
    prefix: str = "mlwe"  # names of actors and placement groups: <prefix>:<workload>:<attempt>
    checkpoint_root: str | None = None  # shared storage for checkpoints; default ./.mlwe/ray
    log_root: str | None = None  # programs' stdout/stderr; default <checkpoint_root>/../logs
    start_timeout_s: float = 120.0  # placement group + actors + programs started
    stop_margin_s: float = 15.0  # beyond grace_s before an unanswering actor is ray.kill-ed
    confirm_timeout_s: float = 60.0  # after the kill: Ray must confirm the actors gone by then
    node_settle_s: float = 15.0  # NodeDown waits at most this long for its attempts' teardown
    #: an actor death its node's death does not explain within this is the workload's error
    #: (an actor on a dying node can be reported dead a moment before the node is)
    actor_death_settle_s: float = 3.0
    telemetry_period_s: float = 1.0
    node_check_period_s: float = 0.25
    progress_step: float = 0.01  # progress is reported when it moved this much (or checkpointed)
    use_state_api: bool | None = None  # None: when the dashboard answers
    runner_concurrency: int = 4  # threads per replica actor (wait, sample, stop at once)
    #: idle runner actors kept started on each node: a start then takes one instead of
    #: waiting for Ray to start a worker process (~1 s); each is used once and replaced
    warm_runners_per_node: int = 1
    close_grace_s: float = 5.0
    #: a last sample (final reports) that takes longer is given up: the actor may be stuck,
    #: and the attempt's release waits on it (a loaded machine can need more)
    drain_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if ":" in self.prefix or not self.prefix:
            raise ValueError(f"prefix {self.prefix!r} must be non-empty and contain no ':'")
        for name in ("start_timeout_s", "confirm_timeout_s", "telemetry_period_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)!r}")
        for name in ("stop_margin_s", "node_settle_s", "node_check_period_s", "close_grace_s",
                     "actor_death_settle_s", "drain_timeout_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must not be negative, got {getattr(self, name)!r}")
        if not 0 < self.progress_step <= 1:
            raise ValueError(f"progress_step must be in (0, 1], got {self.progress_step!r}")
        if self.warm_runners_per_node < 0:
            raise ValueError("warm_runners_per_node must not be negative")
        if self.runner_concurrency < 3:
            raise ValueError("runner_concurrency must be at least 3 (wait, sample and stop)")
