"""What `calibrate` writes: policy.json stays valid JSON, a handful of rows never replaces a calibration without
a word, and "before" is the policy's current calibration. Inputs are `score --raw` style files (no model run)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from cli_cases import SAMPLE
from click.testing import CliRunner

from policyscan.calibration.labeled import id_fraction
from policyscan.cli.main import cli

SEED = 38


def _scores(path, ids: list[str], y: np.ndarray, seed: int = SEED):
    f = np.random.default_rng(seed).normal(size=len(ids)) + 3.0 * y - 1.5
    pq.write_table(pa.table({"id": ids, "f_pii": f, "label": y.astype(int)}), path)
    return path


def _calibrate(*args):
    return CliRunner().invoke(cli, ["calibrate", *map(str, args)])


def _strict_json(text: str) -> dict:
    def refuse(c):
        raise ValueError(f"{c} is not JSON")
    return json.loads(text, parse_constant=refuse)


def test_an_all_one_class_holdout_writes_null_not_nan(tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    ids = [f"row{i}" for i in range(200)]
    held = np.array([id_fraction(i) < 0.25 for i in ids])
    y = np.where(held, 0, np.arange(200) % 2).astype(bool)  # held-out rows: compliant only
    res = _calibrate(_scores(tmp_path / "s.parquet", ids, y), "--policy", bundle, "--from-scores")
    assert res.exit_code == 0, res.output
    assert "roc_auc undefined" in res.output and "n/a" in res.output
    cal = _strict_json((bundle / "policy.json").read_text())["calibration"]
    assert cal["metrics_after"]["roc_auc"] is None and cal["metrics_before"]["roc_auc"] is None
    assert cal["metrics_after"]["positives"] == 0


def test_too_few_rows_per_class_are_refused_unless_forced(tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    before = (bundle / "policy.json").read_text()
    src = _scores(tmp_path / "s.parquet", ["x", "y", "z"], np.array([True, False, True]))
    res = _calibrate(src, "--policy", bundle, "--from-scores", "--holdout", "0")
    assert res.exit_code == 2 and "at least 10 of each" in res.output and "--force" in res.output
    assert (bundle / "policy.json").read_text() == before
    res = _calibrate(src, "--policy", bundle, "--from-scores", "--holdout", "0", "--force")
    assert res.exit_code == 0 and "WARNING: only 2 violation and 1 compliant rows" in res.output
    assert _strict_json((bundle / "policy.json").read_text())["calibration"]["rows"] == 3


def test_before_is_the_policys_current_calibration(tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    meta = json.loads((bundle / "policy.json").read_text())
    a, b = meta["calibration"]["a"], meta["calibration"]["b"]
    ids = [f"row{i}" for i in range(120)]
    src = _scores(tmp_path / "s.parquet", ids, np.arange(120) % 3 == 0)
    res = _calibrate(src, "--policy", bundle, "--from-scores", "--dry-run")
    assert res.exit_code == 0 and f"current a = {a:.6g}, b = {b:.6g}" in res.output, res.output
    y = np.arange(120) % 3 == 0
    f = pq.read_table(src).column("f_pii").to_numpy()
    hold = np.array([id_fraction(i) < 0.25 for i in ids])
    p = 1 / (1 + np.exp(-(a * f[hold] + b)))
    brier = float(np.mean((p - y[hold]) ** 2))
    row = next(line for line in res.output.splitlines() if line.startswith("brier"))
    assert float(row.split()[1]) == round(brier, 4)
