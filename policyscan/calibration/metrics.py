"""Calibration and ranking metrics on probabilities p and 0/1 labels y."""
from __future__ import annotations

import numpy as np


def log_loss(p: np.ndarray, y: np.ndarray, eps: float = 1e-15) -> float:
    p = np.clip(np.asarray(p, dtype=np.float64), eps, 1 - eps)
    y = np.asarray(y, dtype=np.float64)
    return float(-np.mean(y * np.log(p) + (1 - y) * np.log1p(-p)))


def brier(p: np.ndarray, y: np.ndarray) -> float:
    return float(np.mean((np.asarray(p, dtype=np.float64) - np.asarray(y, dtype=np.float64)) ** 2))


def reliability(p: np.ndarray, y: np.ndarray, bins: int = 15) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per equal-width bin: mean predicted p, observed frequency, count (empty bins have count 0)."""
    p, y = np.asarray(p, dtype=np.float64), np.asarray(y, dtype=np.float64)
    idx = np.minimum((p * bins).astype(int), bins - 1)
    count = np.bincount(idx, minlength=bins).astype(np.float64)
    conf = np.bincount(idx, weights=p, minlength=bins)
    acc = np.bincount(idx, weights=y, minlength=bins)
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, conf / count, 0), np.where(count > 0, acc / count, 0), count


def ece(p: np.ndarray, y: np.ndarray, bins: int = 15) -> float:
    """Expected calibration error: bin-weighted |observed frequency - mean p| over 15 equal-width bins."""
    conf, acc, count = reliability(p, y, bins)
    return float(np.sum(count * np.abs(acc - conf)) / max(count.sum(), 1))


def roc_auc(score: np.ndarray, y: np.ndarray) -> float:
    """Probability that a random positive outranks a random negative (ties count half)."""
    score, y = np.asarray(score, dtype=np.float64), np.asarray(y).astype(bool)
    n_pos, n_neg = int(y.sum()), int((~y).sum())
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(score, kind="mergesort")
    ranks = np.empty(len(score))
    sorted_s = score[order]
    # average ranks over ties
    uniq, start, counts = np.unique(sorted_s, return_index=True, return_counts=True)
    avg = start + (counts + 1) / 2.0
    ranks[order] = np.repeat(avg, counts)
    return float((ranks[y].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def summary(p: np.ndarray, y: np.ndarray) -> dict[str, float | None]:
    """The metrics by name; one the rows cannot define (ROC AUC on one class) is None, never NaN (not JSON)."""
    metrics = {"log_loss": log_loss(p, y), "brier": brier(p, y), "ece": ece(p, y), "roc_auc": roc_auc(p, y)}
    return {**{k: v if np.isfinite(v) else None for k, v in metrics.items()},
            "rows": int(len(y)), "positives": int(np.sum(y))}


def ranked_counts(score: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(thresholds, tps, fps): at each distinct score, from the highest down, the positives and negatives at or
    above it (scikit-learn's binary curve: flagged means score >= threshold)."""
    score, y = np.asarray(score, dtype=np.float64), np.asarray(y).astype(bool)
    order = np.argsort(-score, kind="mergesort")
    s, hits = score[order], y[order]
    last = np.r_[np.flatnonzero(np.diff(s)), len(s) - 1] if len(s) else np.zeros(0, dtype=int)
    tps = np.cumsum(hits)[last]
    return s[last], tps, last + 1 - tps


def average_precision(score: np.ndarray, y: np.ndarray) -> float:
    """PR AUC as scikit-learn's average_precision_score: sum over thresholds of (R_k - R_k-1) * P_k; NaN without
    positives (recall is undefined)."""
    _, tps, fps = ranked_counts(score, y)
    if not len(tps) or tps[-1] == 0:
        return float("nan")
    recall = np.r_[0.0, tps / tps[-1]]
    return float(np.sum(np.diff(recall) * tps / (tps + fps)))


def roc_points(score: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(false-positive rate, true-positive rate, threshold) from (0, 0) to (1, 1), as scikit-learn's roc_curve
    with drop_intermediate=False; needs both classes."""
    t, tps, fps = ranked_counts(score, y)
    return np.r_[0.0, fps / fps[-1]], np.r_[0.0, tps / tps[-1]], np.r_[np.inf, t]


def pr_points(score: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(recall, precision, threshold) from the highest threshold down; needs positives."""
    t, tps, fps = ranked_counts(score, y)
    return tps / tps[-1], tps / (tps + fps), t
