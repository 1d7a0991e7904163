"""The service steps of a pipeline run: replicas submitted through the control plane,
their endpoint files, whether the service serves, and scaling it (new replicas proposed,
surplus ones cancelled, converging to the target). A part of :class:`PipelineRunner`
(:mod:`mlwe.pipelines.runner`), which it is mixed into."""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mlwe.core.actions import Action, Cancel, Submit
from mlwe.core.controlplane import ApplyResult
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.pipelines.ports import EngineLike
from mlwe.pipelines.runs import Endpoint, PipelineEvent, StepStatus, _counts, _Run
from mlwe.pipelines.spec import (
    PipelineError,
    StepKind,
    StepSpec,
    render,
)
from mlwe.store.pipelines import PipelineStore, StepRecord

if TYPE_CHECKING:
    import threading


class ServiceSteps:
    """The runner's service-step methods; :class:`PipelineRunner` provides the state and
    the helpers declared here."""

    engine: EngineLike
    store: PipelineStore
    _runs: dict[str, _Run]
    _lock: threading.RLock

    if TYPE_CHECKING:  # provided by PipelineRunner
        def _send(
            self, run: _Run, actions: list[Action], what: str, *, actor: str | None = None,
            force_proposal: bool = False,
        ) -> ApplyResult: ...

        def _emit(
            self, run: _Run, kind: str, step: str | None = None,
            data: Mapping[str, Any] | None = None,
        ) -> PipelineEvent: ...

        def _step_values(self, run: _Run, step: StepSpec) -> dict[str, str]: ...

        def _labels(self, run: _Run, step: StepSpec) -> dict[str, str]: ...

        def _cancel(self, wids: list[str], actor: str, reason: str) -> None: ...

    def endpoints(self, run_id: str, step: str) -> list[Endpoint]:
        """Addresses of the service's replicas that run now (read from their endpoint files)."""
        with self._lock:
            run = self._runs[run_id]
            ids = list(run.steps[step].workloads)
        with self.engine.lock:
            live = {
                wid: (tuple(sorted({a.node for a in w.placement})), w.attempt)
                for wid in ids
                if (w := self.engine.cp.workloads.get(wid)) is not None
                and w.state is State.RUNNING
            }
        out = []
        for wid, (nodes, attempt) in live.items():
            url = self._endpoint_url(run, step, wid, attempt)
            if url:
                out.append(Endpoint(wid, url, nodes))
        return out

    def live_replicas(self, run_id: str, step: str) -> list[str]:
        """Replica workloads of a service that are not gone (queued, starting or running)."""
        with self._lock:
            ids = list(self._runs[run_id].steps[step].workloads)
        with self.engine.lock:
            return [
                wid for wid in ids
                if (w := self.engine.cp.workloads.get(wid)) is not None and _counts(w)
            ]

    def replica_target(self, run_id: str, step: str) -> int:
        with self._lock:
            return self._runs[run_id].targets[step]

    def _replica_spec(self, run: _Run, step: StepSpec, values: dict[str, str]) -> Any:
        k = run.next_replica.get(step.name, 0)
        run.next_replica[step.name] = k + 1
        wid = f"{run.id}.{step.name}.{k}"
        v = dict(values)
        v["replica"] = str(k)
        v["endpoint"] = str(self._endpoint_file(run, step.name, wid))
        Path(v["endpoint"]).parent.mkdir(parents=True, exist_ok=True)
        return run.spec.workload_spec(
            step,
            workload_id=wid,
            command=[render(a, v) for a in step.command],
            labels={**self._labels(run, step), "mlwe.replica": str(k)},
        )

    def _submit_replicas(
        self, run: _Run, step: StepSpec, rec: StepRecord, n: int, values: dict[str, str],
        *, actor: str | None = None, rationale: str | None = None,
    ) -> ApplyResult:
        saved = dict(run.next_replica)
        specs = [self._replica_spec(run, step, values) for _ in range(n)]
        result = self._send(
            run, [Submit(s) for s in specs],
            rationale or f"start {n} replica(s) of service {step.name} of {run.id}",
            actor=actor, force_proposal=rationale is not None,
        )
        if result.accepted:
            rec.workloads = [*rec.workloads, *(s.id for s in specs)]
            rec.workload_id = rec.workload_id or specs[0].id
        else:
            run.next_replica = saved
        return result

    def _endpoint_file(self, run: _Run, step: str, wid: str) -> Path:
        return run.run_dir / "services" / step / f"{wid}.json"

    def _endpoint_url(self, run: _Run, step: str, wid: str, attempt: int) -> str | None:
        """The address a replica wrote, unless an earlier attempt wrote it (a dead process:
        the file outlives it until the new attempt writes its own)."""
        path = self._endpoint_file(run, step, wid)
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict):
            return None
        written_by = data.get("attempt")
        if isinstance(written_by, int) and written_by and written_by != attempt:
            return None
        url = data.get("url")
        return url if isinstance(url, str) else None

    def _follow_service(
        self, run: _Run, step: StepSpec, rec: StepRecord, snap: Mapping[str, Workload]
    ) -> list[PipelineEvent]:
        needs_endpoint = any("${endpoint}" in a.replace(" ", "") for a in step.command)
        if needs_endpoint:
            for wid in rec.workloads:  # a replica that stopped running: its address is void
                w = snap.get(wid)
                if w is not None and w.state is not State.RUNNING:
                    self._endpoint_file(run, step.name, wid).unlink(missing_ok=True)
        running = [
            wid for wid in rec.workloads
            if (w := snap.get(wid)) is not None and w.state is State.RUNNING
            and (not needs_endpoint
                 or self._endpoint_url(run, step.name, wid, w.attempt) is not None)
        ]
        live = [wid for wid in rec.workloads if (w := snap.get(wid)) is not None and _counts(w)]
        rec.attempts = sum(snap[w].attempt for w in rec.workloads if w in snap)
        rec.metrics = {
            "replicas_ready": len(running),
            "replicas_live": len(live),
            "replicas_target": run.targets[step.name],
        }
        if rec.status == StepStatus.SERVING.value:
            self._converge(run, step.name, rec, run.targets[step.name], snap)
        now = self.engine.now()
        if rec.status != StepStatus.SERVING.value:
            if running and len(running) >= min(run.targets[step.name], len(live)):
                rec.status = StepStatus.SERVING.value
                rec.started = rec.started or now
                return [self._emit(run, "step.serving", step.name, {"replicas": len(running)})]
            if not live:
                rec.status = StepStatus.FAILED.value
                rec.finished = now
                rec.error = "every replica failed before the service was up"
                return [self._emit(run, "step.failed", step.name, {"error": rec.error})]
            if running and rec.status == StepStatus.SUBMITTED.value:
                rec.status = StepStatus.RUNNING.value
                rec.started = now
        return []

    def scale_service(
        self, run_id: str, step: str, replicas: int, *, actor: str, rationale: str
    ) -> ApplyResult:
        """Propose the service's replica count: new replicas are submitted, the newest
        extra ones cancelled, all through the control plane (verified and audited)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise KeyError(f"run {run_id!r} is not followed by this runner")
            spec = run.spec.step(step)
            if spec.kind is not StepKind.SERVICE:
                raise PipelineError([f"step {step!r} of {run_id} is not a service"])
            if not 0 <= replicas <= 256:
                raise PipelineError([f"replicas must be within 0..256, got {replicas}"])
            rec = run.steps[step]
            live = self.live_replicas(run_id, step)
            if replicas > len(live):
                values = self._step_values(run, spec)
                result = self._submit_replicas(
                    run, spec, rec, replicas - len(live), values, actor=actor, rationale=rationale
                )
            elif replicas < len(live):
                victims = self._surplus(live, replicas)
                if victims:
                    result = self._send(
                        run, [Cancel(w, f"scaled down by {actor}") for w in victims], rationale,
                        actor=actor, force_proposal=True,
                    )
                else:  # none can be cancelled now (waiting for a retry): the runner converges
                    result = ApplyResult(True, self.engine.cp.version)
            else:
                result = ApplyResult(True, self.engine.cp.version)
            if result.accepted:
                old = run.targets[step]
                run.targets[step] = replicas
                self._emit(run, "service.scaled", step, {"from": old, "to": replicas,
                                                         "actor": actor})
                self.store.save_run(run.record, [rec])
            return result

    def _surplus(self, live: list[str], target: int) -> list[str]:
        """Which of ``live`` to cancel to come down to ``target``: those not running yet
        first, then the newest. A replica that failed and waits for its retry cannot be
        cancelled (the control plane refuses it) and is left for a later pass."""
        with self.engine.lock:
            states = {
                w: x.state for w in live if (x := self.engine.cp.workloads.get(w)) is not None
            }
        can = [w for w in live if states.get(w) not in (None, State.FAILED)]

        def key(wid: str) -> tuple[int, int]:
            return (0 if states[wid] is not State.RUNNING else 1, -int(wid.rsplit(".", 1)[1]))

        return sorted(can, key=key)[: max(0, len(live) - target)]

    def _converge(self, run: _Run, step: str, rec: StepRecord, target: int,
                  snap: Mapping[str, Workload]) -> None:
        """Cancel replicas above the target that the last scaling could not cancel yet
        (e.g. one that came back from a retry), by proposal on the run's behalf."""
        live = [w for w in rec.workloads if (x := snap.get(w)) is not None and _counts(x)]
        if len(live) <= target:
            return
        victims = self._surplus(live, target)
        if victims:
            self._send(
                run, [Cancel(w, f"above the service's target of {target}") for w in victims],
                f"converge service {step} of {run.id} to its target of {target} replica(s)",
                actor=f"pipeline:{run.id}", force_proposal=True,
            )

    def _stop_services(self, run: _Run, reason: str, *, actor: str = "pipelines") -> None:
        for name, rec in run.steps.items():
            if run.spec.step(name).kind is StepKind.SERVICE and rec.status in (
                StepStatus.SERVING.value, StepStatus.RUNNING.value, StepStatus.SUBMITTED.value
            ):
                self._cancel(rec.workloads, actor, reason)
                rec.status = StepStatus.STOPPED.value
                rec.finished = self.engine.now()
