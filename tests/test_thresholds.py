"""Metrics, thresholds and bootstrap intervals on arrays, against scikit-learn's definitions."""
from __future__ import annotations

import json

import numpy as np
import pytest
from sklearn import metrics as skm

from policyscan.calibration.bootstrap import counts, id_seeds, intervals
from policyscan.calibration.evaluation import LabeledScores, evaluate, metrics, verdicts_differ
from policyscan.calibration.metrics import average_precision, pr_points, roc_auc, roc_points
from policyscan.calibration.thresholds import Target, at_threshold, choose, sweep


def _data(n: int, seed: int, ties: bool = False) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.random(n) < 0.3
    p = 1 / (1 + np.exp(-(rng.normal(0, 1.2, n) + 1.5 * y - 0.5)))
    return (np.round(p, 2) if ties else p), y


@pytest.mark.parametrize("seed,ties", [(0, False), (1, True), (2, True)])
def test_ranking_metrics_and_curves_agree_with_sklearn(seed, ties):
    p, y = _data(500, seed, ties)
    assert roc_auc(p, y) == pytest.approx(skm.roc_auc_score(y, p), abs=1e-12)
    assert average_precision(p, y) == pytest.approx(skm.average_precision_score(y, p), abs=1e-12)
    fpr, tpr, thr = roc_points(p, y)
    sk_fpr, sk_tpr, sk_thr = skm.roc_curve(y, p, drop_intermediate=False)
    np.testing.assert_allclose(fpr, sk_fpr)
    np.testing.assert_allclose(tpr, sk_tpr)
    np.testing.assert_array_equal(thr[1:], sk_thr[1:])
    rec, prec, t = pr_points(p, y)
    sk_prec, sk_rec, sk_t = skm.precision_recall_curve(y, p, drop_intermediate=False)
    # scikit-learn: ascending thresholds, then the point (recall 0, precision 1) appended
    np.testing.assert_allclose(prec, sk_prec[:-1][::-1])
    np.testing.assert_allclose(rec, sk_rec[:-1][::-1])
    np.testing.assert_array_equal(t, sk_t[::-1])


@pytest.mark.parametrize("threshold", [0.05, 0.3, 0.5, 0.77, 0.999])
def test_figures_at_a_threshold_agree_with_sklearn(threshold):
    p, y = _data(400, 3)
    at = at_threshold(p, y, threshold)
    pred = p >= threshold
    tn, fp, fn, tp = skm.confusion_matrix(y, pred, labels=[False, True]).ravel()
    assert at["confusion"] == {"tp": tp, "fp": fp, "fn": fn, "tn": tn}
    for name, sk in (("precision", skm.precision_score), ("recall", skm.recall_score), ("f1", skm.f1_score)):
        want = sk(y, pred, zero_division=np.nan)
        assert (at[name] is None) if np.isnan(want) else at[name] == pytest.approx(want, abs=1e-12), name
    assert at["false_positive_rate"] == pytest.approx(fp / (fp + tn))


def test_undefined_figures_are_none_with_the_reason_never_nan():
    p = np.array([0.1, 0.4, 0.8, 0.9])
    one_class = metrics(p, np.zeros(4, dtype=bool), 0.5)
    assert one_class["roc_auc"] is None and one_class["pr_auc"] is None and one_class["recall"] is None
    assert "no violations" in one_class["undefined"]["roc_auc"]
    assert one_class["log_loss"] is not None and one_class["false_positive_rate"] == 0.5
    nothing_flagged = at_threshold(p, np.array([0, 1, 0, 1], dtype=bool), 0.95)
    assert nothing_flagged["precision"] is None and "no row is flagged" in nothing_flagged["undefined"]["precision"]
    res = evaluate(LabeledScores(list("abcd"), p, np.ones(4, dtype=bool)), 0.5, Target("recall", 0.9), 30)
    assert res["roc_auc"] is None and "no compliant rows" in res["undefined"]["roc_auc"]
    json.dumps(res, allow_nan=False)  # NaN would raise
    empty = evaluate(LabeledScores([], np.zeros(0), np.zeros(0, dtype=bool)), 0.5, Target("max_f1"), 10)
    assert empty["rows"] == 0 and empty["roc_auc"] is None and not empty["choice"]["met"]
    json.dumps(empty, allow_nan=False)


@pytest.mark.parametrize("goal", [0.5, 0.8, 0.9, 0.95, 1.0])
def test_target_recall_is_the_highest_threshold_that_reaches_it(goal):
    p, y = _data(300, 4, ties=True)
    ch = choose(p, y, Target("recall", goal))
    assert ch.achieved["recall"] >= goal
    # no threshold above it reaches the goal: the next distinct p above flags too few violations
    above = np.unique(p[p >= ch.threshold])
    if len(above) > 1:
        assert at_threshold(p, y, above[1])["recall"] < goal
    assert at_threshold(p, y, ch.threshold) == ch.achieved


@pytest.mark.parametrize("goal", [0.5, 0.7, 0.9])
def test_target_precision_is_the_lowest_threshold_that_reaches_it(goal):
    p, y = _data(300, 5)
    ch = choose(p, y, Target("precision", goal))
    assert ch.threshold is not None and ch.achieved["precision"] >= goal
    lower = np.unique(p[p < ch.threshold])
    if len(lower):
        assert (at_threshold(p, y, lower[-1])["precision"] or 0) < goal
    unreachable = choose(np.array([0.9, 0.8, 0.7]), np.array([0, 1, 1], dtype=bool), Target("precision", 0.9))
    assert unreachable.threshold is None and "no threshold reaches precision 0.9" in unreachable.reason
    assert "the best is 0.6667" in unreachable.reason


def test_max_f1_is_the_best_f1_over_every_threshold():
    p, y = _data(300, 6, ties=True)
    ch = choose(p, y, Target("max_f1"))
    best = max(skm.f1_score(y, p >= t) for t in np.unique(p))
    assert ch.achieved["f1"] == pytest.approx(best, abs=1e-12)


def test_the_chosen_threshold_sits_in_the_gap_below_the_cut_point():
    """Separable rows: every threshold between the classes gives F1 = 1; the one chosen is midway, not at the
    lowest violation (where a violation scored a hair lower would be missed)."""
    p = np.array([0.01, 0.02, 0.3, 0.7, 0.9, 0.95])
    y = np.array([0, 0, 0, 1, 1, 1], dtype=bool)
    assert choose(p, y, Target("max_f1")).threshold == pytest.approx(0.5)
    assert choose(p, y, Target("recall", 1.0)).threshold == pytest.approx(0.5)
    assert choose(p, np.ones(6, dtype=bool), Target("recall", 1.0)).reason.startswith("no compliant rows")
    assert choose(p, np.zeros(6, dtype=bool), Target("recall", 0.5)).reason.startswith("no violations")


def test_targets_are_checked():
    with pytest.raises(ValueError):
        Target("recall", 1.5)
    with pytest.raises(ValueError):
        Target("recall")
    with pytest.raises(ValueError):
        Target("max_f1", 0.5)


def test_sweep_has_about_twenty_thresholds_with_the_policys():
    p, y = _data(200, 7)
    s = sweep(p, y, (0.42,))
    ts = [r["threshold"] for r in s]
    assert ts == sorted(ts) and 0.42 in ts and len(ts) == 20 and ts[0] == 0.05 and ts[-1] == 0.95


def test_bootstrap_is_poisson_and_the_same_whatever_the_row_order():
    seeds = id_seeds([f"row-{i}" for i in range(200_000)])
    c = counts(seeds, 3)
    assert abs(c.mean() - 1) < 0.01 and abs(c.var() - 1) < 0.02
    assert np.corrcoef(c, counts(seeds, 4))[0, 1] < 0.01
    p, y = _data(300, 8)
    ids = [f"c{i}" for i in range(300)]
    fig = lambda pp, yy: {"auc": roc_auc(pp, yy), "mean": float(pp.mean())}  # noqa: E731
    a = intervals(ids, p, y, fig, 100)
    perm = np.random.default_rng(0).permutation(300)
    b = intervals([ids[i] for i in perm], p[perm], y[perm], fig, 100)
    assert a["auc"] == pytest.approx(b["auc"], abs=1e-12) and a["mean"] == pytest.approx(b["mean"], abs=1e-12)
    assert a["auc"][0] < roc_auc(p, y) < a["auc"][1]
    assert intervals(ids, p, y, fig, 100) == a


def test_verdicts_differ_lists_the_rows_that_cross_the_threshold():
    d = verdicts_differ(["a", "b", "c"], np.array([1, 0, 1], dtype=bool), np.array([0.6, 0.4, 0.9]),
                        np.array([0.4, 0.45, 0.95]), 0.5)
    assert d["rows"] == 1 and d["examples"][0]["id"] == "a" and d["max_abs_dp"] == pytest.approx(0.2)


@pytest.mark.parametrize("kind,value", [("recall", 0.9), ("precision", 0.9), ("max_f1", None)])
def test_rows_of_one_class_choose_no_threshold(kind, value):
    """Violations alone meet any target at every cut point, and none alone meet none: neither can place a
    threshold, and the reason names the class that is missing."""
    p = np.array([0.9, 0.7, 0.4, 0.2])
    target = Target(kind, value)
    for y, missing in ((np.ones(4, bool), "no compliant rows"), (np.zeros(4, bool), "no violations")):
        got = choose(p, y, target)
        assert got.threshold is None and got.reason.startswith(missing), got
