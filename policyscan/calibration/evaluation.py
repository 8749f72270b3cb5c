"""How good a policy is on labeled rows: ranking and calibration metrics, the figures at its threshold, a threshold
sweep, bootstrap intervals and, for a target, the threshold that meets it. The result is JSON as it stands: a
figure the rows cannot define is None with its reason under `undefined`, never NaN."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policyscan.calibration.bootstrap import REPLICATES, intervals
from policyscan.calibration.metrics import average_precision, brier, ece, log_loss, reliability, roc_auc
from policyscan.calibration.thresholds import NO_NEGATIVES, NO_POSITIVES, Target, at_threshold, choose, sweep

RANKING = ("roc_auc", "pr_auc")
CALIBRATION = ("log_loss", "brier", "ece")
AT_THRESHOLD = ("precision", "recall", "f1", "false_positive_rate")
METRICS = RANKING + CALIBRATION + AT_THRESHOLD


@dataclass(frozen=True)
class LabeledScores:
    """One policy's labeled rows: ids, p and y (True: violation), in input order."""

    ids: list
    p: np.ndarray
    y: np.ndarray

    def __post_init__(self) -> None:
        if not len(self.ids) == len(self.p) == len(self.y):
            raise ValueError(f"{len(self.ids)} ids, {len(self.p)} p values and {len(self.y)} labels")
        if len(self.p) and not np.isfinite(self.p).all():
            raise ValueError("p holds values that are not finite")


def metrics(p: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """Every figure of METRICS by name (None where undefined) and the reasons, `undefined`."""
    y = np.asarray(y).astype(bool)
    undefined: dict[str, str] = {}
    out: dict = {}
    if not len(y):
        return {**dict.fromkeys(METRICS), "undefined": dict.fromkeys(METRICS, "no labeled rows")}
    one_class = NO_POSITIVES if not y.any() else NO_NEGATIVES if y.all() else None
    for name, fn in (("roc_auc", roc_auc), ("pr_auc", average_precision)):
        why = one_class if name == "roc_auc" else (NO_POSITIVES if not y.any() else None)
        out[name] = None if why else fn(p, y)
        if why:
            undefined[name] = why
    out.update(log_loss=log_loss(p, y), brier=brier(p, y), ece=ece(p, y))
    at = at_threshold(p, y, threshold)
    out.update({k: at[k] for k in AT_THRESHOLD})
    undefined.update({k: v for k, v in at["undefined"].items() if k in AT_THRESHOLD})
    return {**out, "undefined": undefined}


def evaluate(rows: LabeledScores, threshold: float, target: Target | None = None,
             replicates: int = REPLICATES) -> dict:
    """The figures of one policy on its labeled rows (JSON-ready)."""
    p, y = np.asarray(rows.p, dtype=np.float64), np.asarray(rows.y).astype(bool)
    main = metrics(p, y, threshold)
    at = at_threshold(p, y, threshold)
    choice = choose(p, y, target) if target is not None else None
    conf, acc, count = reliability(p, y) if len(p) else (np.zeros(15), np.zeros(15), np.zeros(15))
    return {
        "rows": int(len(y)), "violations": int(y.sum()), "compliant": int((~y).sum()),
        **{k: main[k] for k in RANKING + CALIBRATION},
        "threshold": float(threshold), **{k: main[k] for k in AT_THRESHOLD},
        "flagged": at["flagged"], "confusion": at["confusion"],
        "undefined": main["undefined"],
        "intervals": intervals(rows.ids, p, y, lambda pp, yy: _figures(pp, yy, threshold), replicates),
        "sweep": [{k: v for k, v in s.items() if k != "undefined"}
                  for s in sweep(p, y, (threshold,) + ((choice.threshold,) if choice and choice.threshold else ()))],
        "reliability": [{"p_mean": float(c), "observed": float(a), "rows": int(n)}
                        for c, a, n in zip(conf, acc, count) if n > 0],
        "choice": choice.record() if choice else None,
    }


def _figures(p: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """METRICS of one bootstrap replicate."""
    m = metrics(p, y, threshold)
    return {k: m[k] for k in METRICS}


def verdicts_differ(ids: list, y: np.ndarray, p_a: np.ndarray, p_b: np.ndarray, threshold: float,
                    limit: int = 100) -> dict:
    """Rows whose verdict at `threshold` differs between two scorings (FP8 and bf16): how many, and the first
    `limit` with their label and both p."""
    diff = np.flatnonzero((np.asarray(p_a) >= threshold) != (np.asarray(p_b) >= threshold))
    return {"rows": int(len(diff)), "share": float(len(diff) / len(ids)) if len(ids) else None,
            "max_abs_dp": float(np.max(np.abs(np.asarray(p_a) - np.asarray(p_b)))) if len(ids) else None,
            "examples": [{"id": ids[i], "violation": bool(y[i]), "p_fp8": float(p_a[i]), "p_bf16": float(p_b[i])}
                         for i in diff[:limit]]}
