"""evaluate's page: per policy the metrics with their intervals, the confusion matrix, a reliability diagram, ROC
and precision-recall curves with the policy's and the chosen threshold marked, and the sweep."""
from __future__ import annotations

from html import escape

import numpy as np

from policyscan.calibration.evaluation import LabeledScores
from policyscan.calibration.metrics import pr_points, reliability, roc_points
from policyscan.report.page import cell, document, pairs, para, section, table
from policyscan.report.svg import Series, chart

METRICS = ("roc_auc", "pr_auc", "log_loss", "brier", "ece", "precision", "recall", "f1", "false_positive_rate")


def evaluation_page(record: dict, rows: dict[str, LabeledScores]) -> str:
    """record: evaluate's JSON; rows: each policy's labeled rows (for the curves)."""
    body = [section("Data", [pairs([("files", ", ".join(record["data"]["files"])),
                                    ("data sha256", record["data"]["sha256"]),
                                    ("scores read from files", record["data"]["from_scores"]),
                                    ("model", (record.get("model") or {}).get("path")),
                                    ("model sha256", (record.get("model") or {}).get("sha256")),
                                    ("device", record.get("device")), ("precision", record.get("precision")),
                                    ("bootstrap", f"{record['bootstrap']['replicates']} replicates, "
                                                  f"{record['bootstrap']['method']}")])], "data")]
    body += [_policy(name, res, rows[name]) for name, res in record["policies"].items()]
    names = ", ".join(record["policies"])
    return document("policyscan evaluate", f"{names} on {len(record['data']['files'])} labeled file(s)", body)


def _policy(name: str, r: dict, rows: LabeledScores) -> str:
    other = r.get("bf16")
    head = ["metric", "value", "95% interval"] + (["bf16"] if other else [])
    lines = []
    for k in METRICS:
        iv = r["intervals"].get(k)
        line = [cell(k), cell(r[k], {"metric": k, "policy": name}),
                cell(f"{iv[0]:.4f} to {iv[1]:.4f}" if iv else "")]
        if other:
            line.append(cell(other[k], {"metric": k, "policy": name, "precision": "bf16"}))
        lines.append(line)
    c = r["confusion"]
    parts = [para(f"{r['rows']:,} labeled rows: {r['violations']:,} violations, {r['compliant']:,} compliant "
                  f"(label column {r['label_column']!r}; {r['unlabeled']:,} rows without a usable label left out). "
                  f"Precision, recall, F1 and the false-positive rate are at the threshold {r['threshold']:g}."),
             table(head, lines),
             table(["", "flagged", "not flagged"],
                   [[cell("violation"), cell(c["tp"], {"metric": "tp", "policy": name}),
                     cell(c["fn"], {"metric": "fn", "policy": name})],
                    [cell("compliant"), cell(c["fp"], {"metric": "fp", "policy": name}),
                     cell(c["tn"], {"metric": "tn", "policy": name})]])]
    parts += [para(f"{k}: undefined ({why})", "warn") for k, why in r["undefined"].items()]
    parts.append(f'<div class="plots">{_plots(r, rows)}</div>')
    if (ch := r.get("choice")) is not None:
        goal = "the best F1" if ch["target"] == "max_f1" else f"{ch['target']} >= {ch['value']:g}"
        parts.append(para(f"{goal}: {ch['reason']}" if not ch["met"] else
                          f"{goal}: threshold {ch['threshold']:.6g} (the policy has {r['threshold']:g})" +
                          (f"; written to {r['written']}" if r.get("written") else "; not written (--write)"),
                          "note" if ch["met"] else "warn"))
    sweep = [[cell(s["threshold"], {"metric": "sweep_threshold", "policy": name}, 4), cell(s["flagged"]),
              cell(s["precision"]), cell(s["recall"]), cell(s["f1"]), cell(s["false_positive_rate"])]
             for s in r["sweep"]]
    parts += ["<h3>Threshold sweep</h3>", table(["threshold", "flagged", "precision", "recall", "F1",
                                                  "false-positive rate"], sweep)]
    if (d := r.get("verdicts_differ")) is not None:
        parts.append(para(f"FP8 and bf16 verdicts differ on {d['rows']:,} rows at {r['threshold']:g}."))
        if d["examples"]:
            parts.append(table(["id", "label", "p FP8", "p bf16"],
                               [[cell(str(e["id"])), cell("violation" if e["violation"] else "compliant"),
                                 cell(e["p_fp8"]), cell(e["p_bf16"])] for e in d["examples"]]))
    return section(f"Policy {name}", parts, f"policy-{escape(name)}")


def _plots(r: dict, rows: LabeledScores) -> str:
    p, y = np.asarray(rows.p), np.asarray(rows.y).astype(bool)
    if not len(p):
        return ""
    conf, acc, count = reliability(p, y)
    keep = count > 0
    out = [chart([Series("observed", conf[keep], acc[keep], dots=True)], "reliability", "mean predicted p",
                 "observed violation rate", diagonal=True)]
    ch = r.get("choice") or {}
    marks = [(r["threshold"], "threshold")] + ([(ch["threshold"], "chosen")] if ch.get("met") else [])
    if y.any() and (~y).any():
        fpr, tpr, _ = roc_points(p, y)
        pts = [(float(np.mean(p[~y] >= t)), float(np.mean(p[y] >= t)), f"{label} {t:.3g}") for t, label in marks]
        out.append(chart([Series(f"ROC (AUC {r['roc_auc']:.3f})", fpr, tpr)], "ROC curve", "false-positive rate",
                         "recall", diagonal=True, marks=pts))
    if y.any():
        rec, prec, _ = pr_points(p, y)
        pts = [(float(np.mean(p[y] >= t)), float(np.mean(y[p >= t])) if (p >= t).any() else 1.0, f"{label} {t:.3g}")
               for t, label in marks]
        out.append(chart([Series(f"precision-recall (AP {r['pr_auc']:.3f})", rec, prec)], "precision-recall curve",
                         "recall", "precision", marks=pts))
    return "".join(out)
