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

from ..calibration.labels import parse_labels
from ..calibration.metrics import summary
from ..calibration.platt import fit_platt, sigmoid
from ..engine.checkpoint import file_sha256
from ..engine.errors import InputError, PolicyscanError
from ..engine.policy import load_policy
from ..engine.runner import Engine, EngineSettings
from ..engine.sources import ReadSpec, expand_inputs, read_chunks
from .common import clip_chars, default_model, engine_options, friendly_errors, model_option


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
@model_option
@click.option("--text-column", default=None, metavar="C")
@click.option("--messages-column", default=None, metavar="C")
@click.option("--id-column", default=None, metavar="C")
@engine_options
@friendly_errors
def calibrate(labeled, policy_dir, label_column, from_scores, holdout, plot, dry_run, model, text_column,
              messages_column, id_column, device, precision, batch_tokens, max_length, cuda_graphs) -> None:
    """Fit p = sigmoid(a*f + b) for one policy (Platt, Newton with line search) and record it in policy.json."""
    policy = load_policy(policy_dir)
    files = expand_inputs(list(labeled))
    if from_scores:
        ids, f, raw_labels = _from_scores(files, policy.name, label_column)
        label_col = label_column or "label"
    else:
        settings = EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs)
        engine = Engine(model or default_model(), [policy], settings)
        spec = ReadSpec(text_column, messages_column, id_column, max_chars=clip_chars(max_length))
        ids, f, raw_labels, label_col = _score(engine, files, spec, label_column)
    y, bad = parse_labels(raw_labels, policy.compliant, policy.violation)
    if bad:
        click.echo(f"{len(bad)} rows have no usable label and are left out, e.g. row {bad[0][0]}: {bad[0][1]}",
                   err=True)
    ok = np.array([v is not None for v in y])
    ids, f, y = [i for i, k in zip(ids, ok) if k], f[ok], np.array([v for v in y if v is not None], dtype=bool)
    hold = np.array([_hashed(i) < holdout for i in ids], dtype=bool)
    fit_rows = ~hold if hold.any() and (~hold).any() else np.ones_like(hold)
    try:
        fit = fit_platt(f[fit_rows], y[fit_rows])
    except ValueError as e:
        raise InputError(f"cannot calibrate {policy.name!r}: {e}") from e
    report = hold if hold.any() and (~hold).any() else np.ones_like(hold)
    before, after = summary(sigmoid(f[report]), y[report]), summary(fit(f[report]), y[report])
    where = "held-out" if report is hold else "fit (no holdout)"
    click.echo(f"policy {policy.name}: a = {fit.a:.6g}, b = {fit.b:.6g} ({fit.iterations} Newton steps, "
               f"{'converged' if fit.converged else 'NOT converged'}), fitted on {int(fit_rows.sum())} rows")
    click.echo(f"{where} rows: {int(report.sum())} ({int(y[report].sum())} violations)")
    click.echo(f"{'metric':<10}{'before':>10}{'after':>10}")
    for k in ("log_loss", "brier", "ece", "roc_auc"):
        click.echo(f"{k:<10}{before[k]:>10.4f}{after[k]:>10.4f}")
    if plot:
        from ..calibration.plot import reliability_plot

        reliability_plot(Path(plot), f"{policy.name} ({where} rows)",
                         {"before (sigmoid f)": (sigmoid(f[report]), y[report]),
                          "after Platt": (fit(f[report]), y[report])})
        click.echo(f"wrote {plot}")
    if dry_run:
        click.echo("--dry-run: policy.json left unchanged")
        return
    _write_calibration(Path(policy_dir), fit, {
        "data_sha256": _data_hash(files), "files": [str(p) for p in files], "rows": int(len(y)),
        "fit_rows": int(fit_rows.sum()), "holdout_rows": int(hold.sum()), "holdout_fraction": holdout,
        "label_column": label_col, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "metrics_before": before, "metrics_after": after, "from_scores": from_scores,
    })
    click.echo(f"updated {Path(policy_dir) / 'policy.json'}")


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
    return ids, f[:, 0].astype(np.float64), labels, col


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
    tmp.write_text(json.dumps(meta, indent=2) + "\n")
    os.replace(tmp, path)
