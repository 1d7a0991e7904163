"""The drift case study's step programs: ``python -m mlwe.pipelines.programs.digits CMD``.

- ``prepare``: the base training set and the clean held-out set (seeded split),
  plus labelled batches from the stream when retraining: those are split
  (seeded) into extra training data and a held-out *recent* set;
- ``train``: fits a support-vector classifier; writes the model (pickle) and
  its metrics; ``train-linear``: a logistic regression exported as plain
  arrays, for the HTTP server of the inference-scaling study;
- ``evaluate``: measures the candidate on the clean and the recent held-out
  sets, and the production model (if one serves) on the same recent set, so a
  promotion compares like with like; writes the evaluated model, the
  reference confidences for drift detection, and the metrics;
- ``serve``: the batch-scoring service: scores every batch that arrives in its
  inbox with the production model (following promotions through the registry's
  pointer file) and writes predictions and confidences to its outbox.

Exit codes: 0 done, 2 bad arguments or inputs (with a message on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import signal
import sys
import time
from pathlib import Path
from typing import Any

try:
    import numpy as np
except ImportError as exc:  # the core install has no NumPy: name the extra that brings it
    from mlwe.core.extras import missing_extra

    raise missing_extra("pipelines", exc) from exc

from mlwe.pipelines.programs import digitsdata as D


def _write_json(path: str, data: dict[str, Any]) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(json.dumps(data, sort_keys=True), encoding="utf-8")
    os.replace(tmp, p)


def _save_npz(path: str, **arrays: Any) -> None:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, p)


def _labelled_batches(labels_dir: str, since: int) -> tuple[D.Array, D.Array, list[int]]:
    xs, ys, used = [], [], []
    for f in sorted(Path(labels_dir).glob("batch-*.npz")):
        k = int(f.stem.split("-")[1])
        if k < since:
            continue
        with np.load(f) as z:
            xs.append(z["X"])
            ys.append(z["y"])
        used.append(k)
    if not xs:
        return np.empty((0, 64)), np.empty((0,), dtype=np.int64), used
    return np.vstack(xs), np.concatenate(ys), used


def cmd_prepare(a: argparse.Namespace) -> int:
    X, y = D.load()
    parts = D.split(a.seed)
    Xtr, ytr = X[parts["train"]], y[parts["train"]]
    Xte, yte = X[parts["test"]], y[parts["test"]]
    Xr, yr = np.empty((0, 64)), np.empty((0,), dtype=np.int64)
    used: list[int] = []
    if a.labels_dir:
        Xn, yn, used = _labelled_batches(a.labels_dir, a.since)
        if len(yn) < a.min_new:
            print(
                f"prepare: {len(yn)} labelled samples since batch {a.since} in {a.labels_dir};"
                f" at least {a.min_new} needed",
                file=sys.stderr,
            )
            return 2
        order = np.random.default_rng(a.seed + 1).permutation(len(yn))
        n_hold = max(1, round(len(yn) * a.holdout_frac))
        hold, extra = order[:n_hold], order[n_hold:]
        Xr, yr = Xn[hold], yn[hold]
        Xtr = np.vstack([Xtr, Xn[extra]])
        ytr = np.concatenate([ytr, yn[extra]])
    _save_npz(a.train_out, X=Xtr, y=ytr)
    _save_npz(a.holdout_out, X_clean=Xte, y_clean=yte, X_recent=Xr, y_recent=yr)
    _write_json(
        a.metrics,
        {
            "train_size": len(ytr),
            "new_samples": int(len(ytr) - len(parts["train"])),
            "recent_holdout_size": len(yr),
            "batches_used": len(used),
        },
    )
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    from sklearn.svm import SVC  # type: ignore[import-untyped]

    with np.load(a.data) as z:
        X, y = z["X"], z["y"]
    model = SVC(gamma=a.gamma, C=a.C).fit(X, y)
    p = Path(a.model_out)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_bytes(pickle.dumps(model))
    _write_json(
        a.metrics,
        {"train_size": len(y), "train_accuracy": float((model.predict(X) == y).mean())},
    )
    return 0


def cmd_train_linear(a: argparse.Namespace) -> int:
    """A multinomial logistic regression, exported as plain arrays (``W``, ``b``, ``scale``):
    serving it needs only NumPy, so a replica starts in a fraction of a second."""
    from sklearn.linear_model import LogisticRegression  # type: ignore[import-untyped]

    with np.load(a.data) as z:
        X, y = z["X"], z["y"]
    scale = 16.0  # pixels are 0..16
    model = LogisticRegression(max_iter=500, C=a.C).fit(X / scale, y)
    p = Path(a.model_out)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp.npz")
    np.savez(tmp, W=model.coef_, b=model.intercept_, classes=model.classes_, scale=scale)
    os.replace(tmp, p)
    _write_json(
        a.metrics,
        {"train_size": len(y), "train_accuracy": float((model.predict(X / scale) == y).mean())},
    )
    return 0


def _load_model(path: str) -> Any:
    return pickle.loads(Path(path).read_bytes())  # an artifact this pipeline wrote


def _acc(model: Any, X: D.Array, y: D.Array) -> float | None:
    return float((model.predict(X) == y).mean()) if len(y) else None


def cmd_evaluate(a: argparse.Namespace) -> int:
    model = _load_model(a.model)
    with np.load(a.holdout) as z:
        Xc, yc, Xr, yr = z["X_clean"], z["y_clean"], z["X_recent"], z["y_recent"]
    if not len(yr):  # no new data yet: the clean held-out set is the most recent one
        Xr, yr = Xc, yc
    metrics: dict[str, Any] = {
        "accuracy_clean": _acc(model, Xc, yc),
        "accuracy": _acc(model, Xr, yr),
        "holdout_size": len(yr),
    }
    pointer = Path(a.pointer)
    if pointer.exists():
        prod = json.loads(pointer.read_text(encoding="utf-8"))
        metrics["baseline_version"] = int(prod["version"])
        metrics["baseline_accuracy"] = _acc(_load_model(prod["path"]), Xr, yr)
    # the confidence this model has on the newest data it was validated on: the drift
    # detector's reference once it serves
    np.save(a.reference_out, D.confidence(model, Xr))
    Path(a.model_out).write_bytes(Path(a.model).read_bytes())
    _write_json(a.metrics, {k: v for k, v in metrics.items() if v is not None})
    return 0


# --------------------------------------------------------------------- serving
_stop = False


def _on_term(signum: int, frame: Any) -> None:
    global _stop
    _stop = True


def cmd_serve(a: argparse.Namespace) -> int:
    signal.signal(signal.SIGTERM, _on_term)
    inbox, outbox = Path(a.inbox), Path(a.outbox)
    outbox.mkdir(parents=True, exist_ok=True)
    pointer = Path(a.pointer)
    model: Any = None
    version: int | None = None
    pointer_mtime = -1.0
    while not _stop:
        try:
            mtime = pointer.stat().st_mtime
        except FileNotFoundError:
            mtime = -1.0
        if mtime != pointer_mtime and mtime >= 0:
            prod = json.loads(pointer.read_text(encoding="utf-8"))
            model, version = _load_model(prod["path"]), int(prod["version"])
            pointer_mtime = mtime
            print(f"serving model version {version}", flush=True)
        if model is not None:
            for f in sorted(inbox.glob("batch-*.npz")):
                out = outbox / (f.stem + ".json")
                if out.exists():
                    continue
                try:
                    with np.load(f) as z:
                        X = z["X"]
                except (OSError, ValueError, EOFError, KeyError) as exc:
                    print(f"skipping unreadable batch {f.name}: {exc}", flush=True)
                    continue
                pred = model.predict(X)
                conf = D.confidence(model, X)
                _write_json(
                    str(out),
                    {
                        "batch": f.stem,
                        "model_version": version,
                        "predictions": [int(p) for p in pred],
                        "confidence": [float(c) for c in conf],
                        "scored_at": time.time(),
                    },
                )
        time.sleep(a.poll)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mlwe.pipelines.programs.digits")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--train-out", required=True)
    p.add_argument("--holdout-out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--labels-dir", default="")
    p.add_argument("--since", type=int, default=0)
    p.add_argument("--min-new", type=int, default=0)
    p.add_argument("--holdout-frac", type=float, default=0.2)
    p = sub.add_parser("train")
    p.add_argument("--data", required=True)
    p.add_argument("--model-out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--gamma", type=float, default=0.001)
    p.add_argument("--C", type=float, default=10.0)
    p = sub.add_parser("train-linear")
    p.add_argument("--data", required=True)
    p.add_argument("--model-out", required=True)
    p.add_argument("--metrics", required=True)
    p.add_argument("--C", type=float, default=1.0)
    p = sub.add_parser("evaluate")
    p.add_argument("--model", required=True)
    p.add_argument("--holdout", required=True)
    p.add_argument("--pointer", required=True)
    p.add_argument("--model-out", required=True)
    p.add_argument("--reference-out", required=True)
    p.add_argument("--metrics", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--pointer", required=True)
    p.add_argument("--inbox", required=True)
    p.add_argument("--outbox", required=True)
    p.add_argument("--poll", type=float, default=0.05)
    a = ap.parse_args(argv)
    fn = {"prepare": cmd_prepare, "train": cmd_train, "train-linear": cmd_train_linear,
          "evaluate": cmd_evaluate, "serve": cmd_serve}[a.cmd]
    try:
        return fn(a)
    except (OSError, ValueError, KeyError) as exc:
        print(f"{a.cmd}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
