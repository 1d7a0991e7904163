"""The pipelines' case studies as figures: one JSON line each (not tests).

    .venv/bin/python benchmarks/case_studies.py

Same as ``mlwe example drift-retrain --json`` and ``mlwe example
inference-scaling --json``, keeping the headline figures only. Both run for
real (local workload daemons, real processes, a real HTTP load); run them on
a quiet machine: latency and time-to-promotion depend on it.
"""

from __future__ import annotations

import json

from mlwe.pipelines import drift_retrain, inference_scaling

DRIFT = ("accuracy_before_drift", "accuracy_on_drift", "accuracy_after_retrain", "promoted",
         "seconds_drift_to_detection", "seconds_drift_to_promotion",
         "holdout_accuracy_candidate", "holdout_accuracy_production", "seconds_total")
SCALING = ("p95_latency_ms", "latency_target_ms", "p50_latency_ms", "p99_latency_ms",
           "max_replicas", "min_replicas", "requests", "errors", "retried_requests",
           "p95_by_phase_ms", "node_failure", "seconds_total")


def main() -> None:
    d = drift_retrain.run()
    print(json.dumps({"bench": "drift-retrain", **{k: d[k] for k in DRIFT}}), flush=True)
    s = inference_scaling.run()
    print(json.dumps({"bench": "inference-scaling", **{k: s[k] for k in SCALING}}), flush=True)


if __name__ == "__main__":
    main()
