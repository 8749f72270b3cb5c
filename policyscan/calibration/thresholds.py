"""What a threshold does on labeled rows (a row is flagged when p >= threshold), the sweep over thresholds, and
the threshold that meets a target: a recall, a precision, or the best F1."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policyscan.calibration.metrics import ranked_counts

TARGETS = ("recall", "precision", "max_f1")
SWEEP = tuple(round(0.05 * k, 2) for k in range(1, 20))  # 0.05 .. 0.95
NO_POSITIVES = "no violations among the labeled rows"
NO_NEGATIVES = "no compliant rows among the labeled rows"
NOTHING_FLAGGED = "no row is flagged at this threshold"


def at_threshold(p: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """Precision, recall, F1, false-positive rate and the confusion matrix at `threshold`, as scikit-learn's
    precision_score, recall_score, f1_score with zero_division=NaN; an undefined value is None and its reason is
    under `undefined`."""
    flag, y = np.asarray(p) >= threshold, np.asarray(y).astype(bool)
    tp, fp = int(np.sum(flag & y)), int(np.sum(flag & ~y))
    fn, tn = int(np.sum(~flag & y)), int(np.sum(~flag & ~y))
    return rates(threshold, tp, fp, fn, tn)


def rates(threshold: float, tp: int, fp: int, fn: int, tn: int) -> dict:
    """The figures at one threshold from its confusion matrix."""
    undefined: dict[str, str] = {}

    def share(num: int, den: int, name: str, why: str) -> float | None:
        if den == 0:
            undefined[name] = why
            return None
        return num / den

    out = {"threshold": float(threshold),
           "precision": share(tp, tp + fp, "precision", NOTHING_FLAGGED),
           "recall": share(tp, tp + fn, "recall", NO_POSITIVES),
           "f1": share(2 * tp, 2 * tp + fp + fn, "f1", f"{NOTHING_FLAGGED} and {NO_POSITIVES}"),
           "false_positive_rate": share(fp, fp + tn, "false_positive_rate", NO_NEGATIVES),
           "flagged": tp + fp, "flagged_share": share(tp + fp, tp + fp + fn + tn, "flagged_share", "no rows"),
           "confusion": {"tp": tp, "fp": fp, "fn": fn, "tn": tn}}
    return {**out, "undefined": undefined}


def sweep(p: np.ndarray, y: np.ndarray, extra: tuple[float, ...] = ()) -> list[dict]:
    """The figures at each of SWEEP's thresholds and at `extra` ones (the policy's, the chosen one), ascending."""
    return [at_threshold(p, y, t) for t in sorted(set(SWEEP) | {float(t) for t in extra})]


@dataclass(frozen=True)
class Target:
    """What a threshold is chosen for: `recall` or `precision` at least `value`, or `max_f1` (no value)."""

    kind: str
    value: float | None = None

    def __post_init__(self) -> None:
        if self.kind not in TARGETS:
            raise ValueError(f"target {self.kind!r}: one of {', '.join(TARGETS)}")
        if (self.kind == "max_f1") != (self.value is None):
            raise ValueError(f"target {self.kind}: {'no value' if self.kind == 'max_f1' else 'a value'} expected")
        if self.value is not None and not 0.0 < self.value <= 1.0:
            raise ValueError(f"target {self.kind} {self.value}: give a value in (0, 1]")

    def describe(self) -> str:
        return "the best F1" if self.kind == "max_f1" else f"{self.kind} >= {self.value:g}"


@dataclass(frozen=True)
class Choice:
    """The threshold chosen for a target and the figures it gives on the rows, or why none meets it."""

    target: Target
    threshold: float | None
    achieved: dict | None
    reason: str | None = None

    def __post_init__(self) -> None:
        if (self.threshold is None) == (self.reason is None):
            raise ValueError("a choice has a threshold or the reason there is none")

    def record(self) -> dict:
        return {"target": self.target.kind, "value": self.target.value, "met": self.threshold is not None,
                "threshold": self.threshold, "achieved": self.achieved, "reason": self.reason}


def choose(p: np.ndarray, y: np.ndarray, target: Target) -> Choice:
    """Among the rows' own p values as cut points: for a recall target the highest that reaches it (the fewest
    flags), for a precision target the lowest (the most recall), for max_f1 the best F1 (the highest among ties).
    The threshold is placed midway between that p and the next lower p of the rows, which flags the same rows
    here, so a conversation scored a hair below the cut point is not lost on new data; it stays inside (0, 1), as
    policy.json requires. Rows of one class choose nothing: the reason says which class is missing."""
    y = np.asarray(y).astype(bool)
    t, tps, fps = ranked_counts(p, y)
    pos = int(y.sum())
    if pos == 0:
        return Choice(target, None, None, f"{NO_POSITIVES}: no threshold can be chosen for {target.describe()}")
    if pos == len(y):  # every cut point "meets" the target, and nothing says how many compliant rows it flags
        return Choice(target, None, None, f"{NO_NEGATIVES}: no threshold can be chosen for {target.describe()}, "
                                          "since what it would flag among compliant conversations is unknown")
    if target.kind == "recall":
        k = int(np.argmax(tps >= target.value * pos - 1e-9 * pos))  # recall only grows as the threshold falls
    elif target.kind == "precision":
        ok = np.flatnonzero(tps >= target.value * (tps + fps) - 1e-12 * (tps + fps))
        if not len(ok):
            best = float(np.max(tps / (tps + fps)))
            return Choice(target, None, None, f"no threshold reaches precision {target.value:g} on these rows "
                                              f"(the best is {best:.4f})")
        k = int(ok[-1])
    else:
        k = int(np.argmax(2 * tps / (tps + fps + pos)))
    below = t[k + 1] if k + 1 < len(t) else 0.0
    threshold = float(np.clip((t[k] + below) / 2.0, np.nextafter(0.0, 1.0), np.nextafter(1.0, 0.0)))
    if threshold > t[k] or (k + 1 < len(t) and threshold <= below):  # no float between them: the cut point itself
        threshold = float(t[k])
    return Choice(target, threshold, at_threshold(p, y, threshold))
