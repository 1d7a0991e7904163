"""Running pipelines: each step a workload submitted through the engine's control plane.

The :class:`PipelineRunner` owns pipeline runs, never cluster state. A step
becomes a workload (``<run>.<step>``; a service replica ``<run>.<step>.<k>``)
submitted through :meth:`Engine.submit` (a user's run) or
:meth:`Engine.propose` (a run an agent started, with its rationale): either
way the control plane verifies it, and queues, quotas, priorities and
preemption apply to it like to any other workload. The runner then follows
the workloads' states:

- a step is submitted once every dependency has succeeded (a service: serves)
  and every input file exists;
- a batch step succeeds when its workload exits 0 *and* every declared output
  exists (then its ``${metrics}`` file is read and, if it registers a model,
  the model becomes a candidate version); it fails when its workload has
  failed for good (retries, ``retries`` of them, are the control plane's);
- a service serves once all of its replicas run (and have written their
  ``${endpoint}`` file, when the command asks for one); it keeps serving until
  the run is stopped, and :meth:`scale_service` adds or cancels replicas
  through the control plane;
- dependents of a failed step are skipped; the run ends ``succeeded``,
  ``failed`` or ``cancelled``, or ``serving`` while its batch steps are done
  and its services run.

Every change is written to ``pipeline_runs`` / ``pipeline_steps`` and
announced to ``listeners`` as a :class:`PipelineEvent` (the supervision
agents' event triggers). The runner never holds the engine lock while it
calls the engine, so it may run on any thread.

The statuses, events and the in-memory run are in :mod:`mlwe.pipelines.runs`;
the service steps (replicas, endpoints, scaling) in :mod:`mlwe.pipelines.services`.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from mlwe.core.actions import Action, Submit
from mlwe.core.controlplane import ApplyResult, Rejection
from mlwe.core.lifecycle import State
from mlwe.core.model import Workload
from mlwe.pipelines.ports import EngineLike
from mlwe.pipelines.runs import (
    FINISHED_RUNS,
    FINISHED_STEPS,
    Endpoint,
    PipelineEvent,
    RunStatus,
    StepStatus,
    _gone,
    _Run,
    _terminally_failed,
)
from mlwe.pipelines.services import ServiceSteps
from mlwe.pipelines.spec import (
    PipelineError,
    PipelineSpec,
    StepKind,
    StepSpec,
    base_values,
    input_path,
    missing_inputs,
    render,
    resolve_params,
)
from mlwe.store.pipelines import ModelRegistry, PipelineStore, RegistryError, RunRecord, StepRecord

log = logging.getLogger("mlwe.pipelines")

__all__ = [
    "FINISHED_RUNS",
    "FINISHED_STEPS",
    "Endpoint",
    "PipelineEvent",
    "PipelineRunner",
    "RunStatus",
    "StepStatus",
    "rejection_reasons",
    "stream_listener",
]


class PipelineRunner(ServiceSteps):
    """Starts and follows pipeline runs on an engine (see the module docstring)."""

    def __init__(
        self,
        engine: EngineLike,
        data_dir: str | Path,
        *,
        store: PipelineStore | None = None,
        registry: ModelRegistry | None = None,
        verify_outputs: bool = True,
    ) -> None:
        self.engine = engine
        self.data_dir = Path(data_dir).resolve()
        self.store = store or PipelineStore(engine.repo)
        self.registry = registry or ModelRegistry(engine.repo, self.data_dir)
        #: False only on backends that run nothing (the simulator): outputs are then taken
        #: as produced when the workload succeeds.
        self.verify_outputs = verify_outputs
        self.listeners: list[Callable[[PipelineEvent], None]] = []
        self._runs: dict[str, _Run] = {}
        self._lock = threading.RLock()

    # ================================================================== start
    def start(
        self,
        spec: PipelineSpec,
        params: Mapping[str, Any] | None = None,
        *,
        run_id: str | None = None,
        actor: str = "user",
        rationale: str | None = None,
        correlation_id: str | None = None,
    ) -> RunRecord:
        """Check and record a new run, and submit the steps that can start now.

        Refused (``PipelineError``, nothing stored or submitted) when a
        parameter is unknown, an input file is missing, a step names a queue
        the cluster does not have, or the run id is taken. ``rationale``
        marks a run started by an agent: its steps are proposals.
        """
        resolved = resolve_params(spec, params)
        with self._lock:
            rid = run_id or self._new_run_id(spec.name)
            if rid in self._runs or self.store.exists(rid):
                raise PipelineError([f"run id {rid!r} is already taken"])
            run_dir = self.data_dir / "runs" / rid
            values = base_values(rid, run_dir, self.data_dir, resolved)
            problems = missing_inputs(spec, self.data_dir, values)
            problems += self._queue_problems(spec)
            if problems:
                raise PipelineError(problems)
            now = self.engine.now()
            record = RunRecord(
                id=rid,
                pipeline=spec.name,
                status=RunStatus.RUNNING.value,
                spec=spec.model_dump(mode="json", by_alias=True),
                params=dict(resolved),
                created=now,
                updated=now,
                correlation_id=correlation_id or rid,
                actor=actor,
                rationale=rationale,
            )
            steps = {
                s.name: StepRecord(rid, s.name, StepStatus.WAITING.value, kind=s.kind.value)
                for s in spec.steps
            }
            run = _Run(spec, record, steps, values, run_dir, actor, rationale)
            for s in spec.steps:
                if s.kind is StepKind.SERVICE:
                    run.targets[s.name] = s.replicas
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / "pipeline.json").write_text(
                json.dumps(record.spec, indent=2, sort_keys=True), encoding="utf-8"
            )
            self.store.save_run(record, list(steps.values()))
            self._runs[rid] = run
            self._emit(run, "run.started", data={"params": dict(resolved), "actor": actor})
        self.advance()
        return record

    def resume(self) -> list[str]:
        """Follow again every run the store holds as running or serving.

        After a restart of whatever drove the runs (the engine keeps their
        workloads), a new runner picks them up where the store left them:
        steps already submitted are followed, the others start when ready.
        Returns the ids of the runs resumed."""
        resumed = []
        with self._lock:
            stored = self.store.runs(limit=10_000, statuses=(
                RunStatus.RUNNING.value, RunStatus.SERVING.value))
            for brief in stored:
                if brief.id in self._runs:
                    continue
                rec = self.store.run(brief.id)
                if rec is None:
                    continue
                try:
                    spec = PipelineSpec.model_validate(rec.spec)
                except ValueError as exc:  # written by an older, incompatible version
                    log.warning("run %s cannot be resumed: %s", rec.id, exc)
                    continue
                steps = {s.step: s for s in rec.steps}
                for s in spec.steps:
                    steps.setdefault(
                        s.name, StepRecord(rec.id, s.name, StepStatus.WAITING.value,
                                           kind=s.kind.value)
                    )
                run_dir = self.data_dir / "runs" / rec.id
                values = base_values(rec.id, run_dir, self.data_dir, rec.params)
                run = _Run(spec, rec, steps, values, run_dir, rec.actor, rec.rationale)
                for s in spec.steps:
                    if s.kind is StepKind.SERVICE:
                        target = steps[s.name].metrics.get("replicas_target", s.replicas)
                        run.targets[s.name] = int(target)
                        ids = steps[s.name].workloads
                        run.next_replica[s.name] = 1 + max(
                            (int(w.rsplit(".", 1)[1]) for w in ids), default=-1
                        )
                self._runs[rec.id] = run
                self._emit(run, "run.resumed", data={"actor": rec.actor})
                resumed.append(rec.id)
        self.advance()
        return resumed

    def _new_run_id(self, pipeline: str) -> str:
        n = self.store.next_number(pipeline)
        while True:
            rid = f"{pipeline}-{n}"
            if rid not in self._runs and not self.store.exists(rid):
                return rid
            n += 1

    def _queue_problems(self, spec: PipelineSpec) -> list[str]:
        with self.engine.lock:
            queues = set(self.engine.cp.queues)
        out = []
        for s in spec.steps:
            q = spec.workload_spec(
                s, workload_id="check", command=s.command, labels={}
            ).queue
            if q not in queues:
                out.append(
                    f"step {s.name!r}: queue {q!r} does not exist (queues: {', '.join(sorted(queues))})"
                )
        return out

    # ================================================================ reading
    def run(self, run_id: str) -> RunRecord:
        """The run as it stands (live if this runner follows it, else from the store)."""
        with self._lock:
            live = self._runs.get(run_id)
            if live is not None:
                rec = live.record
                rec.steps = [live.steps[s.name] for s in live.spec.steps]
                return rec
        stored = self.store.run(run_id)
        if stored is None:
            raise KeyError(f"unknown pipeline run {run_id!r}")
        return stored

    def status(self, run_id: str) -> str:
        return self.run(run_id).status

    def active_runs(self) -> list[str]:
        with self._lock:
            return [r for r, run in self._runs.items() if run.record.status not in FINISHED_RUNS]


    # ================================================================ advance
    def advance(self) -> list[PipelineEvent]:
        """Follow every active run one step: read workload states, submit what is ready."""
        events: list[PipelineEvent] = []
        with self._lock:
            for run in list(self._runs.values()):
                if run.record.status in FINISHED_RUNS:
                    if not run.settled:
                        run.settled = self._reap_stopped(run)
                    continue
                events += self._advance_run(run)
        return events

    def _reap_stopped(self, run: _Run) -> bool:
        """A stopped service keeps no replica: one that was waiting for a retry when its
        run stopped is cancelled once it can be. True once none is left."""
        settled = True
        for name, rec in run.steps.items():
            if rec.kind != StepKind.SERVICE.value or not rec.workloads:
                continue
            with self.engine.lock:
                snap = {w: x for w in rec.workloads
                        if (x := self.engine.cp.workloads.get(w)) is not None and not _gone(x)}
            if snap:
                settled = False
                self._converge(run, name, rec, 0, snap)
        return settled

    def _advance_run(self, run: _Run) -> list[PipelineEvent]:
        events: list[PipelineEvent] = []
        if run.stopping is not None:  # one waiting for a retry when stopped: cancel it now
            for rec in run.steps.values():
                if rec.kind == StepKind.BATCH.value and rec.status in (
                    StepStatus.SUBMITTED.value, StepStatus.RUNNING.value
                ):
                    self._cancel(rec.workloads, "pipelines", run.stopping)
        ids = [w for st in run.steps.values() for w in st.workloads]
        with self.engine.lock:
            snap = {wid: w for wid in ids if (w := self.engine.cp.workloads.get(wid)) is not None}
            states = {wid: (w.state, w.attempt) for wid, w in snap.items()}
        changed: list[StepRecord] = []
        for name in run.spec.order():
            step = run.spec.step(name)
            rec = run.steps[name]
            before = (rec.status, rec.attempts, len(rec.workloads))
            status = StepStatus(rec.status)
            if status is StepStatus.WAITING:
                events += self._maybe_submit(run, step, rec)
            elif step.kind is StepKind.BATCH and status in (
                StepStatus.SUBMITTED, StepStatus.RUNNING
            ):
                assert rec.workload_id is not None
                w = snap.get(rec.workload_id)
                if w is not None:
                    events += self._follow_batch(run, step, rec, w, states[w.id])
            elif step.kind is StepKind.SERVICE and status in (
                StepStatus.SUBMITTED, StepStatus.RUNNING, StepStatus.SERVING
            ):
                events += self._follow_service(run, step, rec, snap)
            if (rec.status, rec.attempts, len(rec.workloads)) != before:
                changed.append(rec)
        events += self._settle(run)
        if changed or events:
            run.record.updated = self.engine.now()
            self._collect(run)
            self.store.save_run(run.record, changed)
        return events

    # ------------------------------------------------------------------ submit
    def _deps_state(self, run: _Run, step: StepSpec) -> str:
        """``ready``, ``wait`` or ``blocked`` (a dependency failed)."""
        for d in run.spec.dependencies(step):
            st = StepStatus(run.steps[d].status)
            dep_kind = run.spec.step(d).kind
            if st in (StepStatus.FAILED, StepStatus.SKIPPED, StepStatus.CANCELLED,
                      StepStatus.STOPPED):
                return "blocked"
            if dep_kind is StepKind.BATCH and st is not StepStatus.SUCCEEDED:
                return "wait"
            if dep_kind is StepKind.SERVICE and st is not StepStatus.SERVING:
                return "wait"
        return "ready"

    def _step_values(self, run: _Run, step: StepSpec) -> dict[str, str]:
        values = dict(run.values)
        values["step"] = step.name
        step_dir = run.run_dir / "steps" / step.name
        values["metrics"] = str(step_dir / "metrics.json")
        for iname, ref in step.inputs.items():
            if ref.step is not None:
                assert ref.output is not None
                values[f"inputs.{iname}"] = run.steps[ref.step].outputs[ref.output]
            else:
                values[f"inputs.{iname}"] = str(input_path(ref, self.data_dir, run.values))
        for oname, rel in step.outputs.items():
            values[f"outputs.{oname}"] = str(run.run_dir / render(rel, values))
        return values

    def _maybe_submit(self, run: _Run, step: StepSpec, rec: StepRecord) -> list[PipelineEvent]:
        deps = self._deps_state(run, step)
        if deps == "blocked":
            rec.status = StepStatus.SKIPPED.value
            rec.error = "a dependency did not succeed"
            return [self._emit(run, "step.skipped", step.name)]
        if deps == "wait":
            return []
        values = self._step_values(run, step)
        if self.verify_outputs:  # a backend that runs nothing writes no files to wait for
            for iname in step.inputs:
                if not Path(values[f"inputs.{iname}"]).exists():
                    return []  # not there yet (an external producer may still be writing it)
        for oname in step.outputs:
            Path(values[f"outputs.{oname}"]).parent.mkdir(parents=True, exist_ok=True)
        Path(values["metrics"]).parent.mkdir(parents=True, exist_ok=True)
        rec.outputs = {o: values[f"outputs.{o}"] for o in step.outputs}
        if step.kind is StepKind.SERVICE:
            result = self._submit_replicas(run, step, rec, run.targets[step.name], values)
        else:
            wid = f"{run.id}.{step.name}"
            spec = run.spec.workload_spec(
                step,
                workload_id=wid,
                command=[render(a, values) for a in step.command],
                labels=self._labels(run, step),
            )
            result = self._send(run, [Submit(spec)], f"run step {step.name} of {run.id}")
            if result.accepted:
                rec.workload_id = wid
                rec.workloads = [wid]
        if not result.accepted:
            rec.status = StepStatus.FAILED.value
            rec.error = "control plane refused the submission: " + "; ".join(result.reasons())
            rec.finished = self.engine.now()
            return [self._emit(run, "step.failed", step.name, {"error": rec.error})]
        rec.status = StepStatus.SUBMITTED.value
        return [self._emit(run, "step.submitted", step.name, {"workloads": list(rec.workloads)})]

    def _labels(self, run: _Run, step: StepSpec) -> dict[str, str]:
        return {"mlwe.pipeline": run.spec.name, "mlwe.run": run.id, "mlwe.step": step.name}


    def _send(
        self, run: _Run, actions: list[Action], what: str, *, actor: str | None = None,
        force_proposal: bool = False,
    ) -> ApplyResult:
        """Through the control plane: a proposal for agents' runs, a submission otherwise."""
        who = actor or run.actor
        cid = run.record.correlation_id
        if force_proposal:
            return self.engine.propose(actions, actor=who, correlation_id=cid, rationale=what)
        if run.rationale is not None or not all(isinstance(a, Submit) for a in actions):
            why = f"{run.rationale}; {what}" if run.rationale else what
            return self.engine.propose(actions, actor=who, correlation_id=cid, rationale=why)
        specs = [a.spec for a in actions if isinstance(a, Submit)]
        return self.engine.submit(specs, actor=who, correlation_id=cid)

    # ------------------------------------------------------------------ follow
    def _follow_batch(
        self, run: _Run, step: StepSpec, rec: StepRecord, w: Workload, st: tuple[State, int]
    ) -> list[PipelineEvent]:
        state, attempt = st
        rec.attempts = attempt
        now = self.engine.now()
        if state in (State.PENDING, State.PREEMPTED):
            reason = w.pending_reason  # the scheduler's words: quota, no node fits, ...
            if reason and run.waiting.get(step.name) != reason:
                run.waiting[step.name] = reason
                return [self._emit(run, "step.waiting", step.name, {"reason": reason})]
            return []
        if state is State.RUNNING and rec.status == StepStatus.SUBMITTED.value:
            rec.status = StepStatus.RUNNING.value
            rec.started = rec.started or now
            return [self._emit(run, "step.running", step.name, {"attempt": attempt})]
        if state is State.SUCCEEDED:
            rec.started = rec.started or now
            rec.finished = now
            return self._succeeded(run, step, rec)
        if state is State.CANCELLED:
            rec.status = StepStatus.CANCELLED.value
            rec.finished = now
            return [self._emit(run, "step.cancelled", step.name)]
        if state is State.FAILED and _terminally_failed(w):
            rec.status = StepStatus.FAILED.value
            rec.finished = now
            rec.error = (
                f"workload {w.id} failed {w.failures} time(s) (retries: {step.retries});"
                f" last: exit {w.exit_code} ({w.failure_cause})"
            )
            return [self._emit(run, "step.failed", step.name, {"error": rec.error})]
        return []

    def _succeeded(self, run: _Run, step: StepSpec, rec: StepRecord) -> list[PipelineEvent]:
        missing = [
            f"{o} ({p})" for o, p in rec.outputs.items() if not Path(p).exists()
        ] if self.verify_outputs else []
        if missing:
            rec.status = StepStatus.FAILED.value
            rec.error = f"exited 0 but did not write its declared output(s): {', '.join(missing)}"
            return [self._emit(run, "step.failed", step.name, {"error": rec.error})]
        rec.metrics = self._read_metrics(run, step)
        rec.status = StepStatus.SUCCEEDED.value
        events = [
            self._emit(
                run, "step.succeeded", step.name,
                {"metrics": dict(rec.metrics), "outputs": dict(rec.outputs)},
            )
        ]
        if step.registers is not None:
            reg = step.registers
            try:
                mv = self.registry.register(
                    reg.name, rec.outputs[reg.output], metrics=dict(rec.metrics),
                    run_id=run.id, time=self.engine.now(),
                )
            except RegistryError as exc:
                rec.status = StepStatus.FAILED.value
                rec.error = f"model registration failed: {exc}"
                return [self._emit(run, "step.failed", step.name, {"error": rec.error})]
            rec.metrics["registered_version"] = mv.version
            events.append(
                self._emit(run, "model.registered", step.name, {"model": mv.to_dict()})
            )
        return events

    def _read_metrics(self, run: _Run, step: StepSpec) -> dict[str, Any]:
        path = run.run_dir / "steps" / step.name / "metrics.json"
        if not path.exists():
            return {}
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            return {"metrics_error": f"unreadable metrics file {path}: {exc}"}
        if not isinstance(data, dict):
            return {"metrics_error": f"metrics file {path} does not hold a JSON object"}
        return {str(k): v for k, v in data.items() if isinstance(v, int | float | str | bool)}


    # ------------------------------------------------------------------ settle
    def _settle(self, run: _Run) -> list[PipelineEvent]:
        statuses = {n: StepStatus(r.status) for n, r in run.steps.items()}
        pending = [
            n for n, st in statuses.items()
            if st not in FINISHED_STEPS and st is not StepStatus.SERVING
        ]
        old = RunStatus(run.record.status)
        if pending:
            new = RunStatus.RUNNING
        elif any(st is StepStatus.FAILED for st in statuses.values()):
            new = RunStatus.FAILED
        elif any(st in (StepStatus.CANCELLED, StepStatus.SKIPPED) for st in statuses.values()):
            new = RunStatus.CANCELLED
        elif any(st is StepStatus.SERVING for st in statuses.values()):
            new = RunStatus.SERVING
        else:
            new = RunStatus.SUCCEEDED
        if new in (RunStatus.FAILED, RunStatus.CANCELLED):
            self._stop_services(run, f"the run {new.value}")
        if new is old:
            return []
        run.record.status = new.value
        return [
            self._emit(
                run, f"run.{new.value}", data={"steps": {n: s.value for n, s in statuses.items()}}
            )
        ]

    def _collect(self, run: _Run) -> None:
        metrics: dict[str, Any] = {}
        artifacts: dict[str, str] = {}
        for name, rec in run.steps.items():
            for k, v in rec.metrics.items():
                metrics[f"{name}.{k}"] = v
            for k, p in rec.outputs.items():
                artifacts[f"{name}.{k}"] = p
        run.record.metrics = metrics
        run.record.artifacts = artifacts

    # ============================================================ operations

    def stop(self, run_id: str, *, actor: str = "user", reason: str = "stopped") -> None:
        """Cancel what the run still has queued or running (services included)."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                raise KeyError(f"run {run_id!r} is not followed by this runner")
            run.stopping = reason
            self._stop_services(run, reason, actor=actor)
            for name, rec in run.steps.items():
                st = StepStatus(rec.status)
                if st is StepStatus.WAITING:
                    rec.status = StepStatus.CANCELLED.value
                elif st in (StepStatus.SUBMITTED, StepStatus.RUNNING) and rec.workload_id:
                    self._cancel(rec.workloads, actor, reason)
                    if run.spec.step(name).kind is StepKind.SERVICE:
                        rec.status = StepStatus.STOPPED.value
            self.store.save_run(run.record, list(run.steps.values()))
        self.advance()


    def _cancel(self, wids: list[str], actor: str, reason: str) -> None:
        for wid in wids:
            with self.engine.lock:
                w = self.engine.cp.workloads.get(wid)
                # a failed replica waiting for its retry cannot be cancelled: once retried,
                # the reaper of stopped services cancels it
                skip = w is None or _gone(w) or w.state in (State.STOPPING, State.FAILED)
            if not skip:
                self.engine.cancel(wid, actor=actor)

    # ================================================================= events
    def _emit(
        self, run: _Run, kind: str, step: str | None = None, data: Mapping[str, Any] | None = None
    ) -> PipelineEvent:
        ev = PipelineEvent(kind, run.id, run.spec.name, self.engine.now(), step, dict(data or {}))
        for listener in list(self.listeners):
            try:
                listener(ev)
            except Exception:  # a broken listener must not stop the runner
                log.exception("pipeline event listener failed")
        return ev

    # ================================================================ driving
    def wait(
        self,
        run_id: str,
        *,
        until: Callable[[RunRecord], bool] | None = None,
        timeout_s: float = 300.0,
        period_s: float = 0.05,
        tick: bool = True,
        on_iteration: Callable[[], None] | None = None,
    ) -> RunRecord:
        """Drive the engine (``tick``) and this runner until the run finishes (or ``until``)."""
        done = until or (lambda r: r.status in {s.value for s in FINISHED_RUNS})
        deadline = time.monotonic() + timeout_s
        while True:
            if tick:
                self.engine.tick()
            self.advance()
            if on_iteration is not None:
                on_iteration()
            rec = self.run(run_id)
            if done(rec):
                return rec
            if time.monotonic() >= deadline:
                raise TimeoutError(f"run {run_id} still {rec.status} after {timeout_s:.0f}s")
            time.sleep(period_s)


def stream_listener(
    publish: Callable[..., Any], runner: PipelineRunner
) -> Callable[[PipelineEvent], None]:
    """A listener that puts pipeline events on an engine's ``state`` stream (the
    dashboard's), e.g. ``runner.listeners.append(stream_listener(engine.streams.publish,
    runner))``."""

    def listen(ev: PipelineEvent) -> None:
        corr = None
        live = runner._runs.get(ev.run_id)
        if live is not None:
            corr = live.record.correlation_id
        publish("state", {"type": "pipeline", **ev.to_dict()}, correlation_id=corr,
                time=ev.time)

    return listen


def rejection_reasons(result: ApplyResult) -> list[str]:
    return [str(r) for r in result.rejections if isinstance(r, Rejection)]
