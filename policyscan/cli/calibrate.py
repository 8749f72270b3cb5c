"""policyscan calibrate: fit a policy's Platt parameters on labeled conversations (or on score --raw output)."""
from __future__ import annotations

import datetime
import os
from pathlib import Path

import click
import numpy as np

from policyscan.calibration.labeled import read_scores, score_labeled, split_holdout
from policyscan.calibration.labels import label_words_note, parse_labels
from policyscan.calibration.metrics import summary
from policyscan.calibration.platt import PlattFit, fit_platt
from policyscan.calibration.plot import PLOT_SUFFIXES, reliability_plot, require_matplotlib
from policyscan.calibration.precision_check import fp8_check
from policyscan.calibration.record import data_sha256, write_calibration
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
    resolve_chat_template,
)
from policyscan.engine.errors import InputError
from policyscan.engine.inputs.rows import ReadSpec, clip_chars
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

MIN_PER_CLASS = 10  # fit rows of each class below which a calibration is not written without --force


@click.command()
@click.argument("labeled", nargs=-1, required=True)
@click.option("--policy", "policy_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="the policy bundle to calibrate (its policy.json is updated)")
@click.option("--label-column", default=None, metavar="C",
              help="0/1, booleans, or the policy's two label strings [default: label, else the policy's name]")
@click.option("--from-scores", is_flag=True,
              help="LABELED is `score --raw` output: read f_<policy> and the label column, score nothing")
@click.option("--holdout", default=0.25, show_default=True, type=Share(0.0, 0.9),
              help="share of rows, chosen by a hash of the id, kept out of the fit for the before/after report")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="write a reliability diagram PNG")
@click.option("--dry-run", is_flag=True, help="report only; leave policy.json unchanged")
@click.option("--force", is_flag=True,
              help=f"write the fit even with fewer than {MIN_PER_CLASS} fit rows of a class (a loud warning)")
@model_option
@click.option("--text-column", default=None, metavar="C")
@click.option("--messages-column", default=None, metavar="C")
@conversation_options
@click.option("--id-column", default=None, metavar="C")
@engine_options
@friendly_errors
def calibrate(labeled, policy_dir, label_column, from_scores, holdout, plot, dry_run, force, model, text_column,
              messages_column, chat_template, text_is_rendered, id_column, device, precision, batch_tokens, max_length,
              cuda_graphs, fp8_flip_limit, threads) -> None:
    """Fit p = sigmoid(a*f + b) for one policy (Platt, Newton with line search) and record it in policy.json.

    Metrics compare the policy's current a, b ("before") with the new fit ("after"); fewer than 10 fit rows
    of a class is a usage error (exit 2) unless --force or --dry-run."""
    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    check_lengths(batch_tokens, max_length, Path(model or default_model()))
    if plot:  # before the scoring, not after it
        require_matplotlib()
        if not plot.lower().endswith(PLOT_SUFFIXES):
            raise click.UsageError(f"--plot {plot}: end the name in one of {', '.join(PLOT_SUFFIXES)} (the suffix "
                                   "sets the image's format)")
        check_writable_dir(Path(plot).parent, "--plot")
    policy = load_policy(policy_dir)
    files = input_files(list(labeled))
    if from_scores:
        data = read_scores(files, policy, label_column)
    else:
        spec = ReadSpec(text_column, messages_column, id_column, max_chars=clip_chars(max_length))
        model_dir = Path(model or default_model())
        template = resolve_chat_template(model_dir, chat_template, [policy], files, spec, text_is_rendered)
        settings = EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs,
                                  chat_template=template, text_is_rendered=text_is_rendered, threads=threads,
                                  fp8_flip_limit=fp8_flip_limit)
        data = score_labeled(Engine(model_dir, [policy], settings), files, spec, label_column)
    y, bad = parse_labels(data.labels, policy.compliant, policy.violation)
    for note in (label_words_note(policy.name, policy.compliant, policy.violation), *data.notes(policy.name)):
        if note:
            click.echo(f"note: {note}", err=True)
    if bad:
        click.echo(f"{len(bad)} rows have no usable label and are left out, e.g. row {bad[0][0]}: {bad[0][1]}",
                   err=True)
    rows = split_holdout(data, y, holdout)
    f, y, fit_rows, report = rows.f, rows.y, rows.fit, rows.report
    _check_class_sizes(y[fit_rows], force, dry_run)
    try:
        fit = fit_platt(f[fit_rows], y[fit_rows])
    except ValueError as e:
        raise InputError(f"cannot calibrate {policy.name!r}: {e}") from e
    current = PlattFit(policy.a, policy.b, 0, True)
    before, after = summary(current(f[report]), y[report]), summary(fit(f[report]), y[report])
    where = "held-out" if rows.held_out else "fit (no holdout)"
    click.echo(f"policy {policy.name}: a = {fit.a:.6g}, b = {fit.b:.6g} ({fit.iterations} Newton steps, "
               f"{'converged' if fit.converged else 'NOT converged'}), fitted on {int(fit_rows.sum())} rows")
    click.echo(f"{where} rows: {int(report.sum())} ({int(y[report].sum())} violations)")
    _report(before, after, policy)
    if plot:
        reliability_plot(Path(plot), f"{policy.name} ({where} rows)",
                         {f"before (a={policy.a:.3g}, b={policy.b:.3g})": (current(f[report]), y[report]),
                          "after Platt": (fit(f[report]), y[report])})
        click.echo(f"wrote {plot}")
    check = None
    if not from_scores:  # what `--precision auto` reads: how far FP8 is from bf16 on these rows, with the new fit
        check = fp8_check(model_dir, policy, settings, files, spec, label_column, fit.a, fit.b)
        click.echo(f"FP8 against bf16 on these {check['rows']} rows ({check['device']}): "
                   f"{check['flip_share']:.1%} of verdicts flip at threshold {policy.threshold}, "
                   f"max |dp| {check['max_dp']:.3g}")
    if dry_run:
        click.echo("--dry-run: policy.json left unchanged")
        return
    path = write_calibration(Path(policy_dir), fit, {
        # relative to the bundle: a policy.json moved with its data, or shipped, names no machine's paths
        "data_sha256": data_sha256(files),
        "files": [os.path.relpath(p.resolve(), policy.path.resolve()) for p in files],
        "rows": int(len(y)),
        "fit_rows": int(fit_rows.sum()), "holdout_rows": int(rows.hold.sum()), "holdout_fraction": holdout,
        "label_column": data.column,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics_before": before, "metrics_after": after, "from_scores": from_scores,
        "replaced": {"a": policy.a, "b": policy.b},  # the calibration "before" was measured with
        **({"fp8_check": check} if check else {}),
    })
    click.echo(f"updated {path}")


def _check_class_sizes(y: np.ndarray, force: bool, dry_run: bool) -> None:
    """A fit on a handful of rows would silently replace a calibration made on many: refused unless forced."""
    pos, neg = int(y.sum()), int((~y).sum())
    if min(pos, neg) >= MIN_PER_CLASS:
        return
    msg = (f"only {pos} violation and {neg} compliant rows to fit on; a calibration needs at least "
           f"{MIN_PER_CLASS} of each")
    if not (force or dry_run):
        raise click.UsageError(f"{msg}: label more rows or lower --holdout (--force writes it anyway)")
    click.echo(f"WARNING: {msg}; the fit is unreliable", err=True)


def _report(before: dict, after: dict, policy) -> None:
    """The before/after table; a metric one class cannot define (ROC AUC) shows n/a and is recorded as null."""
    click.echo(f"{'metric':<10}{'before':>10}{'after':>10}   (before: the policy's current a = {policy.a:.6g}, "
               f"b = {policy.b:.6g})")
    for k in ("log_loss", "brier", "ece", "roc_auc"):
        cells = "".join(f"{'n/a':>10}" if m[k] is None else f"{m[k]:>10.4f}" for m in (before, after))
        click.echo(f"{k:<10}{cells}")
    undefined = sorted({k for m in (before, after) for k, v in m.items() if v is None})
    if undefined:
        click.echo(f"warning: {', '.join(undefined)} undefined on these rows (all one class); recorded as null",
                   err=True)
    if after["log_loss"] > before["log_loss"]:
        click.echo(f"warning: the new fit's log loss ({after['log_loss']:.4f}) is worse than the current "
                   f"calibration's ({before['log_loss']:.4f}) on these rows", err=True)
