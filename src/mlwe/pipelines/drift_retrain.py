"""Case study 1: drift -> retrain -> promote (after Scanflow's MNIST study), run for real.

Everything runs as real processes scheduled by the engine through its control
plane, on scikit-learn's bundled digits (no download):

1. the ``digits-train`` pipeline (prepare -> train -> evaluate) trains a
   support-vector classifier and registers it; the supervisor promotes it to
   production (no production yet);
2. the ``digits-serving`` pipeline's ``score`` service scores every batch that
   arrives in the stream's inbox with the production model;
3. the world sends clean batches, then shifted ones (rotation, noise or
   occlusion; seeded), with their labels arriving alongside (delayed feedback
   collapsed to none);
4. the ``confidence-drift`` sensor runs a two-sample KS test of the served
   model's confidence against its reference and fires;
5. once enough labelled shifted data has arrived, the ``retrain-on-drift`` rule
   reruns ``digits-train`` with it (each step a proposal to the control plane);
6. the new candidate is evaluated beside production on a held-out shifted set
   and the ``promote-if-better`` rule promotes it only if it beats production
   there (the promotion is verified and audited; a worse one is rejected);
7. the service picks up the promotion and scores the rest of the stream.

The stream sends its batches at a fixed pace, holding back its last
``reserve_batches`` until a promotion (or the timeout), so that the
after-retraining accuracy is measured on the same number of batches in every
run. :func:`run` returns the figures and the timeline of what happened.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

try:
    import numpy as np
except ImportError as exc:  # the core install has no NumPy: name the extra that brings it
    from mlwe.core.extras import missing_extra

    raise missing_extra("pipelines", exc) from exc

from mlwe.core.backend import Backend
from mlwe.core.clock import Clock
from mlwe.core.spec import ClusterSpec, NodeSpec
from mlwe.pipelines.drift import KSDriftDetector
from mlwe.pipelines.loop import PipelineLoop
from mlwe.pipelines.programs import digitsdata as D
from mlwe.pipelines.runner import PipelineEvent, PipelineRunner, stream_listener
from mlwe.pipelines.spec import Pipeline, PipelineSpec
from mlwe.pipelines.supervision import (
    Decision,
    Interval,
    Observation,
    OnEvent,
    Supervisor,
    engine_sinks,
)
from mlwe.runtime.clock import WallClock
from mlwe.runtime.engine import Engine, EngineConfig

MODEL = "digits"
PROG = ["${python}", "-m", "mlwe.pipelines.programs.digits"]


@dataclass
class DriftConfig:
    seed: int = 0
    shift: str = "rotation"
    severity: float = 1.0
    batch_size: int = 25
    batch_interval_s: float = 0.25
    clean_batches: int = 6
    reserve_batches: int = 8  # held back until a promotion (see the module docstring)
    retrain_after_batches: int = 12  # labelled shifted batches before retraining
    alpha: float = 1e-3
    window: int = 100
    timeout_s: float = 150.0


def training_pipeline() -> PipelineSpec:
    p = Pipeline(
        "digits-train",
        params={"seed": 0, "labels_dir": "", "since": 0, "min_new": 0},
        defaults={"resources": {"cpu": "500m", "memory": "512Mi"}, "priority": "normal"},
        description="prepare -> train -> evaluate a digits classifier; registers the model",
    )
    prep = p.step(
        "prepare",
        [*PROG, "prepare", "--seed", "${params.seed}", "--train-out", "${outputs.train}",
         "--holdout-out", "${outputs.holdout}", "--metrics", "${metrics}",
         "--labels-dir", "${params.labels_dir}", "--since", "${params.since}",
         "--min-new", "${params.min_new}"],
        outputs={"train": "data/train.npz", "holdout": "data/holdout.npz"},
        workload={"kind": "data-processing"},
    )
    train = p.step(
        "train",
        [*PROG, "train", "--data", "${inputs.data}", "--model-out", "${outputs.model}",
         "--metrics", "${metrics}"],
        inputs={"data": prep.output("train")},
        outputs={"model": "model/candidate.pkl"},
        retries=1,
        workload={"kind": "training"},
    )
    p.step(
        "evaluate",
        [*PROG, "evaluate", "--model", "${inputs.model}", "--holdout", "${inputs.holdout}",
         "--pointer", f"${{data_dir}}/models/{MODEL}/production.json",
         "--model-out", "${outputs.model}", "--reference-out", "${outputs.reference}",
         "--metrics", "${metrics}"],
        inputs={"model": train.output("model"), "holdout": prep.output("holdout")},
        outputs={"model": "model/model.pkl", "reference": "model/reference.npy"},
        registers={"name": MODEL, "output": "model"},
    )
    return p.build()


def serving_pipeline() -> PipelineSpec:
    p = Pipeline("digits-serving", description="batch scoring with the production model")
    p.step(
        "score",
        [*PROG, "serve", "--pointer", f"${{data_dir}}/models/{MODEL}/production.json",
         "--inbox", "${data_dir}/stream/inbox", "--outbox", "${data_dir}/stream/scored"],
        kind="service",
        replicas=1,
        retries=3,
        workload={"resources": {"cpu": "250m", "memory": "256Mi"}, "priority": "high"},
    )
    return p.build()


# ===================================================================== world
@dataclass
class _Stream:
    """The outside world: batches arrive in the inbox, their labels beside them."""

    data_dir: Path
    cfg: DriftConfig
    batches: list[tuple[D.Array, D.Array, bool]] = field(default_factory=list)
    sent: int = 0
    last_sent: float = -1e18
    release_reserve: bool = False
    drift_onset_t: float | None = None
    sent_times: dict[int, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        X, y = D.load()
        pool = D.split(self.cfg.seed)["pool"]
        Xp, yp = X[pool], y[pool]
        n_clean = self.cfg.clean_batches * self.cfg.batch_size
        Xs = D.shift(Xp[n_clean:], self.cfg.shift, self.cfg.seed + 7, self.cfg.severity)
        for k in range(len(yp) // self.cfg.batch_size):
            lo, hi = k * self.cfg.batch_size, (k + 1) * self.cfg.batch_size
            drifted = k >= self.cfg.clean_batches
            Xb = Xs[lo - n_clean : hi - n_clean] if drifted else Xp[lo:hi]
            self.batches.append((Xb, yp[lo:hi], drifted))
        self.inbox = self.data_dir / "stream" / "inbox"
        self.labels = self.data_dir / "stream" / "labels"
        self.inbox.mkdir(parents=True, exist_ok=True)
        self.labels.mkdir(parents=True, exist_ok=True)

    @property
    def done(self) -> bool:
        return self.sent >= len(self.batches)

    def step(self) -> None:
        now = time.monotonic()
        if self.done or now - self.last_sent < self.cfg.batch_interval_s:
            return
        if self.sent >= len(self.batches) - self.cfg.reserve_batches and not self.release_reserve:
            return
        X, y, drifted = self.batches[self.sent]
        name = f"batch-{self.sent:05d}.npz"
        np.savez(self.labels / name, X=X, y=y)
        tmp = self.inbox / f".incoming-{name}"  # not matched by the service's batch-*.npz
        np.savez(tmp, X=X)
        tmp.replace(self.inbox / name)  # the service never sees half a batch
        self.sent_times[self.sent] = now
        if drifted and self.drift_onset_t is None:
            self.drift_onset_t = now
        self.sent += 1
        self.last_sent = now


# ================================================================ supervisor
def build_supervisor(
    sup: Supervisor, data_dir: Path, cfg: DriftConfig, train_spec: PipelineSpec,
    timeline: list[tuple[float, str, dict[str, Any]]],
) -> None:
    """The model-quality agent: drift sensor, retrain rule, promotion rule."""
    scored_dir = data_dir / "stream" / "scored"
    labels_dir = data_dir / "stream" / "labels"
    st = sup.state
    st.update(seen=set(), detector=None, version=None, drift=None, retrain_run=None)
    assert sup.registry is not None
    registry = sup.registry

    def note(what: str, **data: Any) -> None:
        timeline.append((time.monotonic(), what, data))

    def read_drift(s: Supervisor, ev: PipelineEvent | None) -> Observation | None:
        prod = registry.production(MODEL)
        if prod is None:
            return None
        if prod.version != st["version"]:
            ref = np.load(Path(prod.path).with_name("reference.npy"))
            st["detector"] = KSDriftDetector(ref.tolist(), alpha=cfg.alpha, window=cfg.window)
            st["version"] = prod.version
            st["drift"] = None
        det: KSDriftDetector = st["detector"]
        for f in sorted(scored_dir.glob("batch-*.json")):
            if f.name in st["seen"]:
                continue
            st["seen"].add(f.name)
            res = json.loads(f.read_text(encoding="utf-8"))
            if res["model_version"] == st["version"]:
                det.update(res["confidence"])
                st["last_batch"] = int(res["batch"].split("-")[1])
        result = det.test()
        if not result.drift and st["drift"] is None:
            return Observation("confidence-drift", "no drift", fire=False)
        if st["drift"] is None:
            # the window that tested positive began this many batches ago: the onset estimate
            onset = max(0, st["last_batch"] + 1 - cfg.window // cfg.batch_size)
            st["drift"] = {"onset_batch": onset, **result.to_dict()}
            note("drift-detected", p_value=result.p_value, onset_batch=onset,
                 version=st["version"])
        onset = st["drift"]["onset_batch"]
        labelled = len([f for f in labels_dir.glob("batch-*.npz")
                        if int(f.stem.split("-")[1]) >= onset])
        return Observation(
            "confidence-drift",
            f"confidence of model v{st['version']} drifted (KS p={st['drift']['p_value']:.2e});"
            f" {labelled} labelled batch(es) since batch {onset}",
            evidence={**st["drift"], "labelled_batches": labelled, "test_now": result.to_dict()},
            subject=f"{MODEL}:v{st['version']}",
        )

    retrain = _retrain_rule(st, cfg, train_spec, labels_dir)

    read_candidate = _candidate_sensor(note)

    sup.sensor("confidence-drift", read_drift, Interval(0.2))
    sup.rule("retrain-on-drift", "confidence-drift", retrain)
    sup.sensor(
        "candidate-registered", read_candidate,
        OnEvent(("model.registered",), where=lambda ev: ev.data["model"]["name"] == MODEL),
    )
    sup.rule("promote-if-better", "candidate-registered", _promote)


def _retrain_rule(
    st: dict[str, Any], cfg: DriftConfig, train_spec: PipelineSpec, labels_dir: Path,
) -> Callable[[Supervisor, Observation], Decision | None]:
    """Retrain once per drift episode, when enough labelled batches came since its onset."""

    def retrain(s: Supervisor, obs: Observation) -> Decision | None:
        if st["retrain_run"] is not None:
            return None  # one retraining per drift episode
        labelled = int(obs.evidence["labelled_batches"])
        if labelled < cfg.retrain_after_batches:
            return None
        onset = int(obs.evidence["onset_batch"])
        return Decision(
            "rerun-pipeline",
            {
                "pipeline": train_spec,
                "params": {
                    "seed": cfg.seed,
                    "labels_dir": str(labels_dir),
                    "since": onset,
                    "min_new": cfg.retrain_after_batches * cfg.batch_size,
                },
            },
            rationale=(
                f"drift on {MODEL} v{st['version']} (KS p={obs.evidence['p_value']:.2e}) and"
                f" {labelled} labelled batches since batch {onset}: retrain with them"
            ),
            considered=("wait for more labels", "retrain now", "roll back"),
        )

    return retrain


def _candidate_sensor(
    note: Callable[..., None],
) -> Callable[[Supervisor, PipelineEvent | None], Observation | None]:
    """A registered candidate of the model, as an observation (and a timeline note)."""

    def read_candidate(s: Supervisor, ev: PipelineEvent | None) -> Observation | None:
        if ev is None:
            return None
        mv = ev.data["model"]
        note("candidate-registered", version=mv["version"], metrics=mv["metrics"])
        return Observation(
            "candidate-registered",
            f"{MODEL} v{mv['version']} registered by {ev.run_id}"
            f" (accuracy {mv['metrics'].get('accuracy')})",
            evidence={"version": mv["version"], "metrics": mv["metrics"], "run_id": ev.run_id},
            subject=f"{MODEL}:v{mv['version']}",
        )

    return read_candidate


def _promote(s: Supervisor, obs: Observation) -> Decision | None:
    """Promote a registered candidate, saying why (its accuracy against production's)."""
    m = obs.evidence["metrics"]
    base = m.get("baseline_accuracy")
    why = (
        f"candidate v{obs.evidence['version']}: accuracy {m.get('accuracy')} on the held-out"
        + (f" recent set vs production's {base}" if base is not None
           else " set; no production model yet")
    )
    return Decision(
        "promote-model",
        {"model": MODEL, "version": obs.evidence["version"], "metric": "accuracy"},
        rationale=why,
        considered=("promote", "keep production"),
    )


# ======================================================================= run
def _accuracy(rows: list[tuple[list[int], D.Array]]) -> float | None:
    if not rows:
        return None
    right = sum(int((np.asarray(p) == y).sum()) for p, y in rows)
    return right / sum(len(y) for _, y in rows)


def run(
    data_dir: str | Path | None = None,
    cfg: DriftConfig | None = None,
    *,
    backend: Backend | None = None,
    clock: Clock | None = None,
) -> dict[str, Any]:
    """Run the case study; returns the figures, the timeline and the supervisor's records."""
    cfg = cfg or DriftConfig()
    own_dir = data_dir is None
    ddir = Path(data_dir or tempfile.mkdtemp(prefix="mlwe-drift-")).resolve()
    ddir.mkdir(parents=True, exist_ok=True)
    clock = clock or WallClock()
    cluster = ClusterSpec(nodes=(NodeSpec(name="cpu-0", cpu="2", memory="4Gi"),))
    if backend is None:
        backend = default_backend(clock, ddir, cluster)
    engine = Engine.open(
        cluster, backend, data_dir=ddir, clock=clock,
        config=EngineConfig(retry_base_s=0.5, grace_s=2.0, tick_s=0.05),
    )
    runner = PipelineRunner(engine, ddir)
    runner.listeners.append(stream_listener(engine.streams.publish, runner))
    audit, reasoning = engine_sinks(engine)
    sup = Supervisor("model-quality", clock=clock.now, runner=runner, audit=audit,
                     reasoning=reasoning)
    timeline: list[tuple[float, str, dict[str, Any]]] = []
    train_spec = training_pipeline()
    build_supervisor(sup, ddir, cfg, train_spec, timeline)
    stream = _Stream(ddir, cfg)

    def on_event(ev: PipelineEvent) -> None:
        if ev.kind in ("run.started", "run.succeeded", "run.failed", "step.serving"):
            timeline.append((time.monotonic(), ev.kind, {"run": ev.run_id, "step": ev.step}))

    runner.listeners.append(on_event)
    promotions: list[tuple[float, int]] = []

    def watch_promotions() -> None:
        prod = runner.registry.production(MODEL)
        if prod is not None and (not promotions or promotions[-1][1] != prod.version):
            promotions.append((time.monotonic(), prod.version))
            timeline.append((time.monotonic(), "promoted", {"version": prod.version}))
            if len(promotions) >= 2:
                stream.release_reserve = True

    def world() -> None:
        if promotions:  # the stream starts once a model serves
            stream.step()

    loop = PipelineLoop(engine, runner, [sup], period_s=0.05, extra=[watch_promotions, world])
    t0 = time.monotonic()
    try:
        first = runner.start(train_spec, {"seed": cfg.seed}, actor="user")
        serving = runner.start(serving_pipeline(), actor="user")
        sup.state["retrain_run"] = None

        def on_retrain(ev: PipelineEvent) -> None:
            if ev.kind == "run.started" and ev.data.get("actor") == sup.actor:
                sup.state["retrain_run"] = ev.run_id
                timeline.append((time.monotonic(), "retrain-started", {"run": ev.run_id}))

        runner.listeners.append(on_retrain)

        def finished() -> bool:
            if time.monotonic() - t0 > cfg.timeout_s * 0.8:
                stream.release_reserve = True  # give up waiting: send the rest
            scored = len(list((ddir / "stream" / "scored").glob("batch-*.json")))
            return stream.done and scored >= len(stream.batches)

        ok = loop.run_until(finished, cfg.timeout_s)
        runner.stop(serving.id, reason="case study finished")
        loop.run_until(lambda: runner.status(serving.id) != "serving", 10)
        result = _figures(ddir, stream, promotions, runner, first.id, sup, timeline, t0, ok)
        result["errors"] = loop.errors[:20]
    finally:
        engine.close(stop_workloads=True)
        if own_dir:
            shutil.rmtree(ddir, ignore_errors=True)
    result["config"] = asdict(cfg)
    return result


def _figures(
    ddir: Path, stream: _Stream, promotions: list[tuple[float, int]], runner: PipelineRunner,
    first_run: str, sup: Supervisor, timeline: list[tuple[float, str, dict[str, Any]]],
    t0: float, finished: bool,
) -> dict[str, Any]:
    rows: dict[str, list[tuple[list[int], D.Array]]] = {"before": [], "on": [], "after": []}
    first_version = promotions[0][1] if promotions else None
    later = promotions[1][1] if len(promotions) > 1 else None
    for f in sorted((ddir / "stream" / "scored").glob("batch-*.json")):
        res = json.loads(f.read_text(encoding="utf-8"))
        k = int(res["batch"].split("-")[1])
        _, y, drifted = stream.batches[k]
        v = res["model_version"]
        if not drifted and v == first_version:
            rows["before"].append((res["predictions"], y))
        elif drifted and v == first_version:
            rows["on"].append((res["predictions"], y))
        elif drifted and later is not None and v == later:
            rows["after"].append((res["predictions"], y))
    registry = runner.registry
    versions = {v.version: v for v in registry.versions(MODEL)}
    cand = versions.get(later) if later is not None else None
    onset = stream.drift_onset_t
    detected = next((t for t, what, _ in timeline if what == "drift-detected"), None)
    promoted_t = promotions[1][0] if len(promotions) > 1 else None
    return {
        "accuracy_before_drift": _accuracy(rows["before"]),
        "accuracy_on_drift": _accuracy(rows["on"]),
        "accuracy_after_retrain": _accuracy(rows["after"]),
        "promoted": later is not None,
        "seconds_drift_to_detection": None if detected is None or onset is None
        else round(detected - onset, 3),
        "seconds_drift_to_promotion": None if promoted_t is None or onset is None
        else round(promoted_t - onset, 3),
        "holdout_accuracy_candidate": cand.metrics.get("accuracy") if cand else None,
        "holdout_accuracy_production": cand.metrics.get("baseline_accuracy") if cand else None,
        "samples": {k: sum(len(y) for _, y in v) for k, v in rows.items()},
        "shift": stream.cfg.shift,
        "first_model_version": first_version,
        "promoted_version": later,
        "first_run": first_run,
        "models": [v.to_dict() for v in versions.values()],
        "timeline": [
            {"t": round(t - t0, 3), "what": what, **{k: v for k, v in data.items()
                                                    if k != "metrics"}}
            for t, what, data in timeline
        ],
        "supervision": [r.to_dict() for r in sup.records],
        "finished": finished,
        "seconds_total": round(time.monotonic() - t0, 3),
    }


def default_backend(clock: Clock, data_dir: Path, cluster: ClusterSpec) -> Backend:
    """The real backend for the case studies: a workload daemon per node on this machine."""
    from mlwe.runtime.backends import make_backend

    return make_backend("local", clock, cluster, local_nodes_dir=data_dir / "local")
