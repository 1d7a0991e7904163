"""The Ray backend's warm pool: idle runner actors started ahead of need on each node.

A start takes a warm actor pinned to its node instead of waiting for Ray to
start a worker process; each is used once and replaced (``warm_runners_per_node``).
"""

from __future__ import annotations

import time
from typing import Any

from mlwe.backends.ray.state import POOL_TAG, _BackendState, _ray, _Warm, log


class _WarmPool(_BackendState):
    """Keeping, refilling, handing out and draining the warm runner actors."""

    def _pool_entries(self) -> list[_Warm]:
        return [w for entries in self._pool.values() for w in entries]

    def _refill_pool(self) -> None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        want = self.config.warm_runners_per_node
        if not want or self._closed:
            return
        for node, ray_node in self._ray_node.items():
            if node in self._down:
                continue
            entries = self._pool.setdefault(node, [])
            while len(entries) < want:
                name = f"{self.config.prefix}:{POOL_TAG}:{node}:{next(self._pool_seq)}"
                actor = self._runner.options(
                    name=name,
                    lifetime="detached",
                    num_cpus=0,
                    max_restarts=0,
                    max_concurrency=self.config.runner_concurrency,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node, soft=False),
                ).remote({"node": node, "warm": True})
                entries.append(_Warm(node, name, actor, actor.info.remote()))

    def _advance_pool(self, ready: set[Any]) -> None:
        for entries in self._pool.values():
            for warm in list(entries):
                if warm.ready_ref is None or warm.ready_ref not in ready:
                    continue
                ok, value = self._get(warm.ready_ref)
                warm.ready_ref = None
                if ok:
                    warm.ready = True
                else:  # it could not start (its node is going?): forget it, refill later
                    log.debug("warm runner %s failed: %s", warm.name, value)
                    entries.remove(warm)
                    self._kill_quietly(warm.actor)

    def _take_warm(self, node: str) -> _Warm | None:
        entries = self._pool.get(node, [])
        for warm in entries:
            if warm.ready:
                entries.remove(warm)
                return warm
        return None


    def _drain_pool(self) -> None:
        """Kill every warm actor and wait (a little) until Ray confirms them gone."""
        ray = _ray()
        warm = self._pool_entries()
        self._pool.clear()
        for w in warm:
            self._kill_quietly(w.actor)
        deadline = time.monotonic() + 10.0
        pending = list(warm)
        while pending and time.monotonic() < deadline:
            refs = {w.actor.info.remote(): w for w in pending}
            done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=1.0)
            for ref in done:
                ok, value = self._get(ref)
                if not ok and isinstance(value, ray.exceptions.RayActorError) and not isinstance(
                    value, ray.exceptions.ActorUnavailableError
                ):
                    pending.remove(refs[ref])
            if pending:
                time.sleep(0.05)
