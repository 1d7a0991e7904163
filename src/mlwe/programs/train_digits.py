"""A real small training run: ``python -m mlwe.programs.train_digits``.

A linear classifier (scikit-learn ``SGDClassifier``, logistic loss) trained
with mini-batches on scikit-learn's bundled digits data set (no download).
Every source of randomness is seeded by ``--seed`` and the epoch, so the run
is deterministic. On SIGTERM it saves the model and its position (epoch,
batch) as a checkpoint and exits 0; the next attempt resumes from there and
ends with exactly the same model as an uninterrupted run (the final
``RESULT`` line carries a digest of the weights to prove it).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from mlwe import workload as mw


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m mlwe.programs.train_digits", description=__doc__)
    p.add_argument("--epochs", type=int, default=20)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch-delay", type=float, default=0.0,
                   help="seconds to sleep after each batch (stretch the run for demos)")
    p.add_argument("--output", type=Path, default=None,
                   help="write the final result as JSON here (also saved in the checkpoint dir)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.epochs < 1 or args.batch_size < 1:
        print("--epochs and --batch-size must be at least 1", file=sys.stderr)
        return 2
    mw.should_stop()  # install the SIGTERM hook before the (slow) imports

    try:
        import numpy as np
        from sklearn.datasets import load_digits  # type: ignore[import-untyped]
        from sklearn.linear_model import SGDClassifier  # type: ignore[import-untyped]
        from sklearn.metrics import log_loss  # type: ignore[import-untyped]
    except ImportError as exc:  # scikit-learn is in mlwe[pipelines], not the core install
        from mlwe.core.extras import missing_extra

        print(f"error: {missing_extra('pipelines', exc)}", file=sys.stderr)
        return 2

    digits = load_digits()
    x = digits.data / 16.0
    y = digits.target
    order = np.random.RandomState(args.seed).permutation(len(y))
    n_train = 1400
    x_train, y_train = x[order[:n_train]], y[order[:n_train]]
    x_test, y_test = x[order[n_train:]], y[order[n_train:]]
    classes = np.unique(y)
    n_batches = (n_train + args.batch_size - 1) // args.batch_size
    total = args.epochs * n_batches

    state: dict[str, Any] | None = mw.resume_state()
    if state is not None:
        clf = state["model"]
        epoch, batch = int(state["epoch"]), int(state["batch"])
        print(f"resumed at epoch {epoch}, batch {batch}", flush=True)
    else:
        clf = SGDClassifier(loss="log_loss", alpha=1e-4, random_state=args.seed)
        epoch, batch = 0, 0
    done = epoch * n_batches + batch
    mw.report(step=done, progress=done / total, resumed_from=done / total)

    while epoch < args.epochs:
        perm = np.random.RandomState(args.seed * 1000 + epoch).permutation(n_train)
        while batch < n_batches:
            idx = perm[batch * args.batch_size:(batch + 1) * args.batch_size]
            clf.partial_fit(x_train[idx], y_train[idx], classes=classes)
            batch += 1
            done += 1
            if args.batch_delay:
                time.sleep(args.batch_delay)
            if mw.should_stop():
                mw.save_state({"model": clf, "epoch": epoch, "batch": batch},
                              progress=done / total, step=done)
                print(f"stopped by SIGTERM at epoch {epoch}, batch {batch}; checkpoint saved",
                      flush=True)
                return 0
        epoch, batch = epoch + 1, 0
        loss = float(log_loss(y_train, clf.predict_proba(x_train), labels=classes))
        acc = float((clf.predict(x_test) == y_test).mean())
        mw.report(step=done, loss=loss, progress=done / total, accuracy=acc, epoch=epoch)

    digest = hashlib.sha256(clf.coef_.tobytes() + clf.intercept_.tobytes()).hexdigest()
    result = {
        "test_accuracy": float((clf.predict(x_test) == y_test).mean()),
        "weights_sha256": digest,
        "epochs": args.epochs,
    }
    text = json.dumps(result, sort_keys=True)
    (mw.checkpoint_dir() / "result.json").write_text(text)
    if args.output is not None:
        args.output.write_text(text)
    print(f"RESULT {text}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
