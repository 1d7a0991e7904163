"""The digits data set, split and shifted reproducibly (shared by the programs and the driver).

scikit-learn bundles the 8x8 digits (1,797 images), so nothing is downloaded.
One seeded permutation splits them into a base training set, a clean
held-out set, and a pool that feeds the incoming stream; the pool never
overlaps the others. A *shift* (rotation, noise or occlusion, seeded per
sample) makes a drifted version of any images.
"""

from __future__ import annotations

from typing import Any

try:
    import numpy as np
    from numpy.typing import NDArray
except ImportError as exc:  # the core install has no NumPy: name the extra that brings it
    from mlwe.core.extras import missing_extra

    raise missing_extra("pipelines", exc) from exc

N_TRAIN = 400
N_TEST = 150
SHIFTS = ("rotation", "noise", "occlusion")

Array = NDArray[Any]


def load() -> tuple[Array, Array]:
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    data = load_digits()
    return np.asarray(data.data, dtype=np.float64), np.asarray(data.target, dtype=np.int64)


def split(seed: int) -> dict[str, Array]:
    """Index arrays: ``train`` (base training), ``test`` (clean held-out), ``pool`` (stream)."""
    X, _ = load()
    idx = np.random.default_rng(seed).permutation(len(X))
    return {
        "train": idx[:N_TRAIN],
        "test": idx[N_TRAIN : N_TRAIN + N_TEST],
        "pool": idx[N_TRAIN + N_TEST :],
    }


def shift(X: Array, kind: str, seed: int, severity: float = 1.0) -> Array:
    """A drifted copy of ``X`` (rows of 64 pixels in 0..16)."""
    if kind not in SHIFTS:
        raise ValueError(f"unknown shift {kind!r} (known: {', '.join(SHIFTS)})")
    from scipy import ndimage  # type: ignore[import-untyped]

    rng = np.random.default_rng(seed)
    out = np.empty_like(X, dtype=np.float64)
    for i, x in enumerate(X):
        im = x.reshape(8, 8).astype(np.float64)
        if kind == "rotation":
            angle = severity * 30.0 * rng.choice([-1.0, 1.0]) + rng.normal(0.0, 5.0)
            im = ndimage.rotate(im, angle, reshape=False, order=1, mode="constant")
            im = im + rng.normal(0.0, 2.0 * severity, im.shape)
        elif kind == "noise":
            im = im + rng.normal(0.0, 5.0 * severity, im.shape)
        else:  # occlusion: a blank band across a random third of the image
            w = max(1, round(3 * severity))
            r = int(rng.integers(0, 8 - w + 1))
            if rng.random() < 0.5:
                im[r : r + w, :] = 0.0
            else:
                im[:, r : r + w] = 0.0
            im = im + rng.normal(0.0, 1.0, im.shape)
        out[i] = np.clip(im, 0.0, 16.0).ravel()
    return out


def confidence(model: Any, X: Array) -> Array:
    """How sure the classifier is: the margin between its two best classes' scores."""
    scores = np.sort(np.asarray(model.decision_function(X)), axis=1)
    return np.asarray(scores[:, -1] - scores[:, -2])
