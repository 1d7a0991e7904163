"""The simulated backend, live: the simulator's cluster paced to the engine's clock.

``mlwe serve --backend sim`` runs the real engine (store, bus, agent, API) over
a simulated cluster: every poll advances the discrete-event kernel to the
engine's current time, so simulated workloads start, checkpoint, finish, fail
and stream telemetry as time passes. A workload's true run time is drawn, when
it starts, from its estimate (seeded noise around ``estimated_duration``, or a
default); the scheduler never sees it (DESIGN "honest knowledge").
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from mlwe.core.backend import Command, Event, RunningAttempt, StartCommand, Telemetry
from mlwe.core.clock import Clock
from mlwe.core.spec import WorkloadSpec
from mlwe.sim.backend import SimBackend, SimBackendConfig
from mlwe.sim.kernel import Kernel


def true_duration(spec: WorkloadSpec, default_s: float, seed: int = 0) -> float:
    """A reproducible true run time: the estimate (or default) times a factor in [0.7, 1.3)."""
    base = spec.estimated_duration or default_s
    h = hashlib.blake2b(f"{seed}:{spec.id}".encode(), digest_size=4).digest()
    return base * (0.7 + 0.6 * int.from_bytes(h, "big") / 2**32)


class LiveSimBackend:
    """A :class:`SimBackend` whose kernel follows ``clock`` (the Backend protocol)."""

    name = "sim"

    def __init__(
        self,
        clock: Clock,
        config: SimBackendConfig | None = None,
        *,
        default_duration_s: float = 600.0,
        seed: int = 0,
    ) -> None:
        self.clock = clock
        self.kernel = Kernel(start=clock.now())
        self.durations: dict[str, float] = {}
        cfg = config or SimBackendConfig(telemetry_interval_s=5.0, eviction_delay_s=2.0, seed=seed)
        self.sim = SimBackend(self.kernel, self.durations, cfg)
        self.default_duration_s = default_duration_s
        self.seed = seed

    def _advance(self) -> None:
        now = self.clock.now()
        if now > self.kernel.clock.t:
            self.kernel.run(until=now)

    def send(self, commands: Sequence[Command]) -> None:
        self._advance()
        for c in commands:
            if isinstance(c, StartCommand) and c.workload not in self.durations:
                self.durations[c.workload] = true_duration(c.spec, self.default_duration_s, self.seed)
        self.sim.send(commands)

    def poll(self) -> list[Event]:
        self._advance()
        return self.sim.poll()

    def drain_telemetry(self) -> list[Telemetry]:
        self._advance()
        return self.sim.drain_telemetry()

    def inventory(self) -> list[RunningAttempt]:
        return self.sim.inventory()

    def close(self) -> None:
        self.sim.close()

    def fail_node(self, node: str, down_for: float | None = None) -> None:
        """Inject a node failure now (and its recovery ``down_for`` seconds later)."""
        self._advance()
        self.sim.fail_node(self.kernel.clock.t, node, down_for)
