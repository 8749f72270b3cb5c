"""policyscan evaluate: how good each policy is on labeled rows, which threshold meets a target, and (--write) that
threshold recorded in policy.json."""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
from pathlib import Path

import click
import numpy as np

from policyscan.calibration import evaluation
from policyscan.calibration.bootstrap import LEVEL, METHOD, REPLICATES
from policyscan.calibration.evaluation import LabeledScores, verdicts_differ
from policyscan.calibration.labeled import read_scores, score_labeled_policies
from policyscan.calibration.labels import label_words_note, parse_labels
from policyscan.calibration.record import data_sha256, write_atomic, write_threshold
from policyscan.calibration.thresholds import Target
from policyscan.cli.common import (
    Share,
    check_lengths,
    check_writable_dir,
    conversation_options,
    default_model,
    engine_options,
    friendly_errors,
    input_files,
    model_option,
    protected_files,
    refuse_overwrites,
    resolve_chat_template,
)
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.inputs.rows import ReadSpec, clip_chars
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings, version
from policyscan.report.evaluation_page import evaluation_page

SHOWN = ("roc_auc", "pr_auc", "log_loss", "brier", "ece", "precision", "recall", "f1", "false_positive_rate")


@click.command("evaluate")
@click.argument("labeled", nargs=-1, required=True)
@click.option("--policy", "policy_dirs", multiple=True, required=True, type=click.Path(exists=True, file_okay=False),
              help="a policy bundle to evaluate (repeat for several)")
@click.option("--label-column", default=None, metavar="C",
              help="0/1, booleans, or the policy's two label strings [default: label, else the policy's name]")
@click.option("--from-scores", is_flag=True,
              help="LABELED is score output: read f_<policy> (calibrated with the policy's a, b), else p_<policy>")
@click.option("--target-recall", type=Share(0.0, 1.0), default=None, metavar="R",
              help="choose the highest threshold whose recall is at least R")
@click.option("--target-precision", type=Share(0.0, 1.0), default=None, metavar="P",
              help="choose the lowest threshold whose precision is at least P")
@click.option("--max-f1", is_flag=True, help="choose the threshold of the best F1")
@click.option("--write", is_flag=True, help="record the chosen threshold, and how it was chosen, in policy.json")
@click.option("--json", "json_path", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="write the figures as JSON")
@click.option("-o", "--output", "page", default=None, type=click.Path(dir_okay=False), metavar="REPORT.html",
              help="write a page: reliability diagram, ROC and precision-recall curves, the sweep")
@click.option("--bootstrap", default=REPLICATES, show_default=True, type=click.IntRange(0, 10000), metavar="N",
              help="bootstrap replicates for the 95% intervals (0: none)")
@model_option
@click.option("--text-column", default=None, metavar="C")
@click.option("--messages-column", default=None, metavar="C")
@conversation_options
@click.option("--id-column", default=None, metavar="C")
@engine_options
@friendly_errors
def evaluate(labeled, policy_dirs, label_column, from_scores, target_recall, target_precision, max_f1, write,
                 json_path, page, bootstrap, model, text_column, messages_column, chat_template, text_is_rendered,
                 id_column, device, precision, batch_tokens, max_length, cuda_graphs, fp8_flip_limit, threads) -> None:
    """Measure each policy on labeled rows: ROC AUC, PR AUC, log loss, Brier, ECE, and at its threshold precision,
    recall, F1, false-positive rate and the confusion matrix, with 95% bootstrap intervals and a threshold sweep.

    With a target (--target-recall, --target-precision, --max-f1) it picks the threshold that meets it on these
    rows; --write records it in policy.json, nothing is changed without it."""
    target = _target(target_recall, target_precision, max_f1, write)
    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    check_lengths(batch_tokens, max_length, Path(model or default_model()))
    policies = [load_policy(d) for d in policy_dirs]
    if len({p.name for p in policies}) != len(policies):
        raise click.UsageError("a policy is named twice among --policy; give each once")
    files = input_files(list(labeled))
    model_dir = Path(model or default_model())
    refuse_overwrites([(Path(p), what) for p, what in ((json_path, "--json"), (page, "-o")) if p],
                      protected_files(files, model_dir, [p.path for p in policies]))
    for path, what in ((json_path, "--json"), (page, "-o")):
        if path:  # before the scoring: a folder that is not there is found now, not after all the work
            check_writable_dir(Path(path).parent, what)
    run: dict = {"model": None, "device": None, "precision": None}
    bf16 = None
    if from_scores:
        data = [read_scores(files, p, label_column, ("f", "p")) for p in policies]
        for pol, d in zip(policies, data):
            if d.score == "p":
                click.echo(f"{pol.name}: no f_{pol.name} column (score --raw): p_{pol.name} is read as it was "
                           "scored, not with the policy's current calibration", err=True)
        scores = [p.calibrate_np(d.f) if d.score == "f" else d.f for p, d in zip(policies, data)]
    else:
        spec = ReadSpec(text_column, messages_column, id_column, max_chars=clip_chars(max_length))
        template = resolve_chat_template(model_dir, chat_template, policies, files, spec, text_is_rendered)
        settings = EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs,
                                  chat_template=template, text_is_rendered=text_is_rendered, threads=threads,
                                  fp8_flip_limit=fp8_flip_limit)
        engine = Engine(model_dir, policies, settings)
        run = {"model": {"path": str(model_dir.resolve()), "sha256": engine.model_sha256},
               "device": str(engine.device), "precision": engine.precision.name}
        data = score_labeled_policies(engine, files, spec, label_column)
        scores = [p.calibrate_np(d.f) for p, d in zip(policies, data)]
        if engine.precision.name == "fp8":  # the accurate mode beside it, and the verdicts that move
            del engine
            again = Engine(model_dir, policies, dataclasses.replace(settings, precision="bf16"))
            bf16 = [p.calibrate_np(d.f) for p, d in zip(policies, score_labeled_policies(again, files, spec,
                                                                                          label_column))]
    results = {}
    for j, (pol, d, p) in enumerate(zip(policies, data, scores)):
        y, bad = parse_labels(d.labels, pol.compliant, pol.violation)
        for note in (label_words_note(pol.name, pol.compliant, pol.violation), *d.notes(pol.name)):
            if note:
                click.echo(f"note: {note}", err=True)
        if bad:
            click.echo(f"{pol.name}: {len(bad)} rows have no usable label and are left out, e.g. row {bad[0][0]}: "
                       f"{bad[0][1]}", err=True)
        ok = np.array([v is not None for v in y], dtype=bool)
        rows = LabeledScores([i for i, k in zip(d.ids, ok) if k], p[ok], np.array([v for v in y if v is not None],
                                                                                  dtype=bool))
        res = evaluation.evaluate(rows, pol.threshold, target, bootstrap)
        res.update(label_column=d.column, unlabeled=len(bad), scores=d.score)
        if bf16 is not None:
            res["bf16"] = evaluation.evaluate(dataclasses.replace(rows, p=bf16[j][ok]), pol.threshold, None, bootstrap)
            res["verdicts_differ"] = verdicts_differ(rows.ids, rows.y, rows.p, bf16[j][ok], pol.threshold)
        results[pol.name] = (res, rows)
        _print(pol.name, res)
    record = {"policyscan_version": version(),
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "data": {"files": [str(f) for f in files], "sha256": data_sha256(files), "from_scores": from_scores},
              **run, "bootstrap": {"replicates": bootstrap, "level": LEVEL, "method": METHOD},
              "target": dataclasses.asdict(target) if target else None,
              "policies": {name: res for name, (res, _) in results.items()}}
    if write:
        _write(policies, results, record, target)
    if json_path:
        write_atomic(Path(json_path), json.dumps(record, indent=2, allow_nan=False, default=str) + "\n")
        click.echo(f"wrote {json_path}")
    if page:
        write_atomic(Path(page), evaluation_page(record, {n: rows for n, (_, rows) in results.items()}))
        click.echo(f"wrote {page}")


def _target(recall: float | None, precision: float | None, max_f1: bool, write: bool) -> Target | None:
    given = [t for t in (("recall", recall), ("precision", precision), ("max_f1", max_f1 or None)) if t[1] is not None]
    if len(given) > 1:
        raise click.UsageError("give one of --target-recall, --target-precision, --max-f1")
    if write and not given:
        raise click.UsageError("--write records a chosen threshold: give --target-recall, --target-precision or "
                               "--max-f1")
    if not given:
        return None
    kind, value = given[0]
    if kind != "max_f1" and value == 0:
        raise click.UsageError(f"--target-{kind} 0 is met by any threshold; give a value in (0, 1]")
    return Target(kind, None if kind == "max_f1" else value)


def _num(v: float | None) -> str:
    return f"{'n/a':>8}" if v is None else f"{v:>8.4f}"


def _print(name: str, r: dict) -> None:
    """One policy's figures: metrics with intervals (bf16 beside them when the device ran FP8), the confusion
    matrix, the sweep and the chosen threshold."""
    click.echo(f"policy {name}: {r['rows']} labeled rows ({r['violations']} violations, {r['compliant']} compliant)"
               f", label column {r['label_column']!r}")
    other = r.get("bf16")
    head = f"{'metric':<27}{'value':>8}  {'95% interval':<20}" + (f"{'bf16':>8}" if other else "")
    click.echo(head)
    for k in SHOWN:
        iv = r["intervals"].get(k)
        band = f"[{iv[0]:.4f}, {iv[1]:.4f}]" if iv else ""
        label = k if k in ("roc_auc", "pr_auc", "log_loss", "brier", "ece") else f"{k} @ {r['threshold']:g}"
        click.echo(f"{label:<27}{_num(r[k])}  {band:<20}" + (_num(other[k]) if other else ""))
    c = r["confusion"]
    click.echo(f"confusion @ {r['threshold']:g}: tp {c['tp']}  fp {c['fp']}  fn {c['fn']}  tn {c['tn']}")
    for k, why in r["undefined"].items():
        click.echo(f"warning: {name}: {k} is undefined ({why}); recorded as null", err=True)
    click.echo(f"{'threshold':>10}{'flagged':>9}{'precision':>11}{'recall':>9}{'f1':>9}{'fpr':>9}")
    for s in r["sweep"]:
        click.echo(f"{s['threshold']:>10.4g}{s['flagged']:>9}" + "".join(
            f"{'n/a' if s[k] is None else format(s[k], '.4f'):>{w}}"
            for k, w in (("precision", 11), ("recall", 9), ("f1", 9), ("false_positive_rate", 9))))
    if (d := r.get("verdicts_differ")) is not None:
        click.echo(f"FP8 and bf16 verdicts differ on {d['rows']} of {r['rows']} rows at {r['threshold']:g} "
                   f"(max |dp| {d['max_abs_dp'] or 0:.3g})" + "".join(
                       f"\n  {e['id']}: p fp8 {e['p_fp8']:.4f}, bf16 {e['p_bf16']:.4f}, "
                       f"{'violation' if e['violation'] else 'compliant'}" for e in d["examples"][:10]))
    if (ch := r["choice"]) is not None:
        goal = "the best F1" if ch["target"] == "max_f1" else f"{ch['target']} >= {ch['value']:g}"
        if not ch["met"]:
            click.echo(f"{goal}: {ch['reason']}")
        else:
            a = ch["achieved"]
            click.echo(f"{goal}: threshold {ch['threshold']:.6g} (now {r['threshold']:g}) gives precision "
                       f"{_num(a['precision']).strip()}, recall {_num(a['recall']).strip()}, F1 "
                       f"{_num(a['f1']).strip()}, false-positive rate {_num(a['false_positive_rate']).strip()}, "
                       f"flagging {a['flagged']} of {r['rows']} rows")


def _write(policies: list, results: dict, record: dict, target: Target) -> None:
    """Every policy's chosen threshold into its policy.json, or none when a target cannot be met on some."""
    unmet = [p.name for p in policies if not results[p.name][0]["choice"]["met"]]
    if unmet:
        raise PolicyscanError(f"{target.describe()} cannot be met for {', '.join(unmet)} on these rows; no "
                              "policy.json was changed")
    for pol in policies:
        res = results[pol.name][0]
        ch = res["choice"]
        path = write_threshold(pol.path, ch["threshold"], {
            "target": ch["target"], "value": ch["value"], "achieved": {k: ch["achieved"][k] for k in (
                "precision", "recall", "f1", "false_positive_rate", "flagged", "flagged_share")},
            "data_sha256": record["data"]["sha256"],
            "files": [os.path.relpath(Path(f).resolve(), pol.path.resolve()) for f in record["data"]["files"]],
            "rows": res["rows"], "violations": res["violations"], "label_column": res["label_column"],
            "from_scores": record["data"]["from_scores"], "precision": record["precision"],
            "calibration": {"a": pol.a, "b": pol.b}, "replaced": pol.threshold, "date": record["date"]})
        record["policies"][pol.name]["written"] = str(path)
        click.echo(f"updated {path}: threshold {pol.threshold:g} -> {ch['threshold']:.6g}")
