"""Data drift detection: a two-sample Kolmogorov-Smirnov test against a reference.

The detector holds a reference sample (e.g. the production model's prediction
confidence on the held-out set it was validated on) and a sliding window of
the latest observations (the confidence on what the service scored). The test
asks whether both come from the same distribution; a p-value below ``alpha``
on a full window is drift. A model that sees unfamiliar inputs grows less
confident, so this needs no labels, only the model's own outputs.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from mlwe.core.extras import missing_extra


@dataclass(frozen=True)
class DriftResult:
    drift: bool
    p_value: float
    statistic: float
    window: int  # observations tested
    reference: int  # size of the reference sample
    reference_mean: float
    window_mean: float

    def to_dict(self) -> dict[str, float | int | bool]:
        return {
            "drift": self.drift,
            "p_value": self.p_value,
            "statistic": self.statistic,
            "window": self.window,
            "reference": self.reference,
            "reference_mean": self.reference_mean,
            "window_mean": self.window_mean,
        }


class KSDriftDetector:
    """Two-sample KS test of a sliding window against a reference sample."""

    def __init__(
        self, reference: Sequence[float], *, alpha: float = 1e-3, window: int = 100
    ) -> None:
        if len(reference) < 20:
            raise ValueError(f"a drift reference needs at least 20 values, got {len(reference)}")
        if not 0 < alpha < 1:
            raise ValueError(f"alpha must be within (0, 1), got {alpha}")
        if window < 20:
            raise ValueError(f"the window must hold at least 20 values, got {window}")
        try:  # SciPy is in mlwe[pipelines], not the core install: fail at construction
            from scipy.stats import ks_2samp  # type: ignore[import-untyped]
        except ImportError as exc:
            raise missing_extra("pipelines", exc) from exc
        self._ks_2samp = ks_2samp
        self.reference = [float(x) for x in reference]
        self.alpha = alpha
        self.window: deque[float] = deque(maxlen=window)

    def reset(self, reference: Sequence[float] | None = None) -> None:
        """Start again (after a promotion the new model's reference replaces the old)."""
        if reference is not None:
            if len(reference) < 20:
                raise ValueError("a drift reference needs at least 20 values")
            self.reference = [float(x) for x in reference]
        self.window.clear()

    def update(self, values: Iterable[float]) -> None:
        self.window.extend(float(v) for v in values)

    @property
    def full(self) -> bool:
        return len(self.window) == self.window.maxlen

    def test(self) -> DriftResult:
        """The test on the current window; drift only on a full window."""
        w = list(self.window)
        ref_mean = sum(self.reference) / len(self.reference)
        if len(w) < 2:
            return DriftResult(False, 1.0, 0.0, len(w), len(self.reference), ref_mean, 0.0)
        res = self._ks_2samp(self.reference, w)
        p = float(res.pvalue)
        stat = float(res.statistic)
        return DriftResult(
            drift=self.full and p < self.alpha,
            p_value=p,
            statistic=stat,
            window=len(w),
            reference=len(self.reference),
            reference_mean=ref_mean,
            window_mean=sum(w) / len(w),
        )
