"""policyscan calibrate: fit a policy's Platt parameters on labeled conversations (or on score --raw output)."""
from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import os
from pathlib import Path

import click
import numpy as np

from policyscan.calibration.labels import parse_labels
from policyscan.calibration.precision_check import fp8_check
from policyscan.calibration.metrics import summary
from policyscan.calibration.platt import PlattFit, fit_platt
from policyscan.calibration.plot import reliability_plot, require_matplotlib
from policyscan.engine.files import file_sha256
from policyscan.engine.errors import InputError, PolicyscanError
from policyscan.engine.policy import load_policy
from policyscan.engine.runner import Engine, EngineSettings
from policyscan.engine.sources import ReadSpec, read_chunks
from policyscan.cli.common import (chat_template_option, check_lengths, clip_chars, default_model, engine_options,
                                   friendly_errors, input_files, model_option, resolve_chat_template)

MIN_PER_CLASS = 10  # fit rows of each class below which a calibration is not written without --force


@click.command()
@click.argument("labeled", nargs=-1, required=True)
@click.option("--policy", "policy_dir", required=True, type=click.Path(exists=True, file_okay=False),
              help="the policy bundle to calibrate (its policy.json is updated)")
@click.option("--label-column", default=None, metavar="C",
              help="0/1, booleans, or the policy's two label strings [default: label, else the policy's name]")
@click.option("--from-scores", is_flag=True,
              help="LABELED is `score --raw` output: read f_<policy> and the label column, score nothing")
@click.option("--holdout", default=0.25, show_default=True, type=click.FloatRange(0.0, 0.9),
              help="share of rows, chosen by a hash of the id, kept out of the fit for the before/after report")
@click.option("--plot", type=click.Path(dir_okay=False), default=None, help="write a reliability diagram PNG")
@click.option("--dry-run", is_flag=True, help="report only; leave policy.json unchanged")
@click.option("--force", is_flag=True,
              help=f"write the fit even with fewer than {MIN_PER_CLASS} fit rows of a class (a loud warning)")
@model_option
@click.option("--text-column", default=None, metavar="C")
@click.option("--messages-column", default=None, metavar="C")
@chat_template_option
@click.option("--id-column", default=None, metavar="C")
@engine_options
@friendly_errors
def calibrate(labeled, policy_dir, label_column, from_scores, holdout, plot, dry_run, force, model, text_column,
              messages_column, chat_template, id_column, device, precision, batch_tokens, max_length,
              cuda_graphs, fp8_flip_limit, threads) -> None:
    """Fit p = sigmoid(a*f + b) for one policy (Platt, Newton with line search) and record it in policy.json.

    Metrics compare the policy's current a, b ("before") with the new fit ("after"); fewer than 10 fit rows
    of a class is a usage error (exit 2) unless --force or --dry-run."""
    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    check_lengths(batch_tokens, max_length)
    if plot:
        require_matplotlib()  # before the scoring, not after it
    policy = load_policy(policy_dir)
    files = input_files(list(labeled))
    if from_scores:
        ids, f, raw_labels = _from_scores(files, policy.name, label_column)
        label_col = label_column or "label"
    else:
        spec = ReadSpec(text_column, messages_column, id_column, max_chars=clip_chars(max_length))
        model_dir = Path(model or default_model())
        template = resolve_chat_template(model_dir, chat_template, [policy], files, spec)
        settings = EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs,
                                  chat_template=template, threads=threads,
                                  fp8_flip_limit=fp8_flip_limit)
        engine = Engine(model_dir, [policy], settings)
        ids, f, raw_labels, label_col, convs = _score(engine, files, spec, label_column)
    y, bad = parse_labels(raw_labels, policy.compliant, policy.violation)
    if bad:
        click.echo(f"{len(bad)} rows have no usable label and are left out, e.g. row {bad[0][0]}: {bad[0][1]}",
                   err=True)
    ok = np.array([v is not None for v in y])
    ids, f, y = [i for i, k in zip(ids, ok) if k], f[ok], np.array([v for v in y if v is not None], dtype=bool)
    hold = np.array([_hashed(i) < holdout for i in ids], dtype=bool)
    fit_rows = ~hold if hold.any() and (~hold).any() else np.ones_like(hold)
    _check_class_sizes(y[fit_rows], force, dry_run)
    try:
        fit = fit_platt(f[fit_rows], y[fit_rows])
    except ValueError as e:
        raise InputError(f"cannot calibrate {policy.name!r}: {e}") from e
    report = hold if hold.any() and (~hold).any() else np.ones_like(hold)
    current = PlattFit(policy.a, policy.b, 0, True)
    before, after = summary(current(f[report]), y[report]), summary(fit(f[report]), y[report])
    where = "held-out" if report is hold else "fit (no holdout)"
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
        check = fp8_check(model_dir, policy, settings, convs, fit.a, fit.b)
        click.echo(f"FP8 against bf16 on these {check['rows']} rows ({check['device']}): "
                   f"{check['flip_share']:.1%} of verdicts flip at threshold {policy.threshold}, "
                   f"max |dp| {check['max_dp']:.3g}")
    if dry_run:
        click.echo("--dry-run: policy.json left unchanged")
        return
    _write_calibration(Path(policy_dir), fit, {
        # relative to the bundle: a policy.json moved with its data, or shipped, names no machine's paths
        "data_sha256": _data_hash(files), "files": [os.path.relpath(p.resolve(), policy.path.resolve()) for p in files],
        "rows": int(len(y)),
        "fit_rows": int(fit_rows.sum()), "holdout_rows": int(hold.sum()), "holdout_fraction": holdout,
        "label_column": label_col, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics_before": before, "metrics_after": after, "from_scores": from_scores,
        "replaced": {"a": policy.a, "b": policy.b},  # the calibration "before" was measured with
        **({"fp8_check": check} if check else {}),
    })
    click.echo(f"updated {Path(policy_dir) / 'policy.json'}")


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


def _score(engine: Engine, files: list[Path], spec: ReadSpec, label_column: str | None):
    ids, texts, labels, rows, col = [], [], [], [], None
    for path in files:
        col = label_column or _label_guess(path, spec, engine.policies[0].name)
        spec_l = ReadSpec(spec.text_column, spec.messages_column, spec.id_column, (col,), max_chars=spec.max_chars)
        for chunk in read_chunks(path, spec_l, engine.encoder.render):
            for i, t in enumerate(chunk.texts):
                if t is None:
                    raise InputError(f"{path}, row {chunk.first_row + i}: {chunk.errors[i]}; fix the labeled data")
            ids += chunk.ids.to_pylist()
            texts += chunk.texts
            labels += chunk.keep[col].to_pylist()
            rows += [(path, chunk.first_row + i) for i in range(len(chunk.texts))]
    convs = [np.asarray(x, dtype=np.int64) for x in engine.encoder.encode_batch(texts)]
    for (path, row), c in zip(rows, convs):
        if not len(c):  # a tokenizer that normalizes a text away: every labeled row must be scored
            raise InputError(f"{path}, row {row}: the conversation encodes to no tokens; fix the labeled data")
    f, _, _ = engine.score_conversations(convs)
    return ids, f[:, 0].astype(np.float64), labels, col, convs


def _label_guess(path: Path, spec: ReadSpec, policy_name: str) -> str:
    import pyarrow.parquet as pq

    if path.name.endswith(".parquet"):
        names = pq.ParquetFile(path).schema_arrow.names
    else:
        opener = gzip.open if path.name.endswith(".gz") else open
        with opener(path, "rt", encoding="utf-8") as fh:
            names = list(json.loads(fh.readline()))
    for guess in ("label", policy_name):
        if guess in names:
            return guess
    raise InputError(f"{path}: no label column ('label' or {policy_name!r}) among {names}; pass --label-column")


def _from_scores(files: list[Path], name: str, label_column: str | None):
    import polars as pl

    col = label_column or "label"
    frames = [pl.read_parquet(p) if p.name.endswith(".parquet") else pl.read_ndjson(p) for p in files]
    df = pl.concat(frames, how="diagonal_relaxed")
    if "policy" in df.columns and "f" in df.columns:  # --layout long
        df = df.filter(pl.col("policy") == name).rename({"f": f"f_{name}"})
    for need in ("id", f"f_{name}", col):
        if need not in df.columns:
            raise InputError(f"{files[0]}: no column {need!r} among {df.columns}; score with --raw "
                             f"--keep {col} to make calibration input")
    return df["id"].to_list(), df[f"f_{name}"].cast(pl.Float64).to_numpy(), df[col].to_list()


def _hashed(id_) -> float:
    """A fixed number in [0, 1) per id: the same rows are held out on every run."""
    return int.from_bytes(hashlib.sha256(str(id_).encode()).digest()[:8], "big") / 2.0 ** 64


def _data_hash(files: list[Path]) -> str:
    h = hashlib.sha256()
    for p in files:
        h.update(file_sha256(p).encode())
    return h.hexdigest()


def _write_calibration(bundle: Path, fit, provenance: dict) -> None:
    if not np.isfinite([fit.a, fit.b]).all():
        raise PolicyscanError("calibration produced non-finite parameters; policy.json left unchanged")
    path = bundle / "policy.json"
    meta = json.loads(path.read_text())
    meta["calibration"] = {"a": fit.a, "b": fit.b, "method": "platt-newton (Lin, Lin & Weng 2007)", **provenance}
    tmp = path.with_name(f".policy.json.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")  # NaN is not JSON: never written
    os.replace(tmp, path)
