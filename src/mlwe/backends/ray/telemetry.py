"""The Ray backend's telemetry: per replica and per node samples, and progress facts.

Every ``telemetry_period_s``: per replica, CPU and RSS of the process tree and
the workload helper's latest report; GPU figures are the declared allocation
(labelled so); per node, whether its Ray node is alive and, from the state API,
how many actors are alive on it. The first replica's progress and checkpoints
become ``Progress`` facts.
"""

from __future__ import annotations

from typing import Any

from mlwe.backends.ray.adoption import _Adoption
from mlwe.backends.ray.state import _Attempt, _Phase, _ray, _Replica, log
from mlwe.core.actions import Progress
from mlwe.core.backend import Telemetry


class _Sampling(_Adoption):
    """Sampling the running replicas and their nodes."""

    def _sample(self) -> None:
        """Collect the replica samples asked for last period, ask for the next ones, and add
        a sample per node (aggregates of its replicas, and what Ray says of it)."""
        ray = _ray()
        now = self.clock.now()
        running = [a for a in self._attempts.values() if a.phase is _Phase.RUNNING]
        refs = [r.sample_ref for a in running for r in a.replicas if r.sample_ref is not None]
        ready: set[Any] = set()
        if refs:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0, fetch_local=True)
            ready = set(done)
        per_node: dict[str, dict[str, float]] = {
            n: {"cpu_pct": 0.0, "rss_mib": 0.0, "workloads": 0.0, "gpus_allocated": 0.0,
                "vram_allocated_mib": 0.0}
            for n in self.node_specs
        }
        for att in running:
            for rep in att.replicas:
                agg = per_node.get(rep.node)
                alloc = att.placement[rep.index] if rep.index < len(att.placement) else None
                if agg is not None:
                    agg["workloads"] += 1
                    if alloc is not None:
                        agg["gpus_allocated"] += alloc.gpu_per_device * len(alloc.devices) / 1000
                        agg["vram_allocated_mib"] += alloc.res.vram
                if rep.sample_ref is not None and rep.sample_ref in ready:
                    ok, value = self._get(rep.sample_ref)
                    rep.sample_ref = None
                    if ok:
                        metrics = self._take_sample(att, rep, value, now)
                        if agg is not None:
                            agg["cpu_pct"] += metrics.get("cpu_pct", 0.0)
                            agg["rss_mib"] += metrics.get("rss_mib", 0.0)
                if rep.sample_ref is None and rep.actor is not None:
                    rep.sample_ref = rep.actor.sample.remote()
        alive_actors = self._actors_per_node() if self._use_state_api() else None
        for name, spec in self.node_specs.items():
            agg = per_node[name]
            metrics = {k: round(v, 2) for k, v in agg.items()}
            metrics["cpu_util"] = round(agg["cpu_pct"] / 100 / max(spec.cpu / 1000, 1e-9), 4)
            metrics["ray_alive"] = 0.0 if name in self._down else 1.0
            if agg["workloads"]:
                # the machine, as measured by an actor running there (none runs: none measured)
                metrics.update(self._host.get(name, {}))
            rn = self._ray_node.get(name)
            if alive_actors is not None and rn is not None:
                metrics["ray_actors_alive"] = float(alive_actors.get(rn, 0))
            declared: tuple[str, ...] = ()
            if spec.gpus:
                # no NVML reading here: the GPU figures are what the control plane allocated
                metrics["vram_used_mib"] = agg["vram_allocated_mib"]
                declared = ("gpus_allocated", "vram_allocated_mib", "vram_used_mib")
            self._telemetry.append(Telemetry(now, name, None, metrics, declared))

    def _actors_per_node(self) -> dict[str, int] | None:
        try:
            from ray.util.state import list_actors

            out: dict[str, int] = {}
            for a in list_actors(address=self._api_url, filters=[("state", "=", "ALIVE")],
                                 limit=10_000, timeout=5):
                if a.node_id:
                    out[a.node_id] = out.get(a.node_id, 0) + 1
            return out
        except Exception as exc:
            log.debug("state API list_actors failed: %s", exc)
            return None

    def _take_sample(
        self, att: _Attempt, rep: _Replica, value: dict[str, Any], now: float
    ) -> dict[str, float]:
        """One replica's sample: telemetry, and (first replica) progress facts."""
        metrics: dict[str, float] = {
            k: float(v) for k, v in (value.get("metrics") or {}).items()
            if isinstance(v, int | float) and not isinstance(v, bool)
        }
        alloc = att.placement[rep.index] if rep.index < len(att.placement) else None
        declared: tuple[str, ...] = ()
        if alloc is not None and alloc.devices:
            metrics["gpus"] = alloc.gpu_per_device * len(alloc.devices) / 1000
            if value.get("gpu_measured"):
                declared = ("gpus",)  # the allocation; utilisation, power, VRAM are NVML's
            else:
                # no GPU to read on that node: the figures are the allocation, labelled so
                metrics["vram_used_mib"] = float(alloc.res.vram)
                declared = ("gpus", "vram_used_mib")
        host = value.get("host")
        if isinstance(host, dict):
            self._host[rep.node] = {
                k: float(v) for k, v in host.items()
                if isinstance(v, int | float) and not isinstance(v, bool)
            }
        metrics["replica"] = float(rep.index)
        metrics["attempt"] = float(att.attempt)
        self._telemetry.append(Telemetry(now, rep.node, att.workload, metrics, declared))
        # progress is the first replica's (rank 0) to tell, and only while it runs: once a
        # stop is asked, what was saved travels in Released
        if rep.index != 0:
            return metrics
        for msg in value.get("reports") or ():
            p = msg.get("progress")
            if msg.get("checkpoint") and isinstance(p, int | float) and 0.0 <= p <= 1.0:
                att.checkpoint_progress = float(p)
                if not att.stop_requested:
                    att.progress_sent = float(p)
                    self._emit(Progress(att.workload, att.attempt, float(p), checkpointed=True),
                               att.correlation_id)
        if not att.stop_requested:
            p = value.get("progress")
            if isinstance(p, int | float) and 0.0 <= p <= 1.0 and (
                p - att.progress_sent >= self.config.progress_step
                or (p >= 1.0 > att.progress_sent)
            ):
                att.progress_sent = float(p)
                self._emit(Progress(att.workload, att.attempt, float(p)), att.correlation_id)
        return metrics
