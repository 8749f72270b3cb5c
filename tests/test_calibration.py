"""Platt fit against scikit-learn, metrics, label parsing, and `policyscan calibrate` end to end."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import run
from click.testing import CliRunner

from policyscan.calibration.labels import label_words_note, parse_labels
from policyscan.calibration.metrics import brier, ece, log_loss, roc_auc
from policyscan.calibration.platt import fit_platt
from policyscan.cli.main import cli

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"


def _rng() -> np.random.Generator:
    """Fresh random data each run, its seed printed (shown with a failure) so the draw can be replayed."""
    seed = int(np.random.SeedSequence().entropy % 2**63)
    print(f"numpy seed {seed}")
    return np.random.default_rng(seed)


@pytest.mark.parametrize("sep", [0.0, 0.7, 3.0, 12.0])  # random, overlapping, separable-ish, separated
@pytest.mark.parametrize("n", [7, 200, 3000])
def test_platt_agrees_with_sklearn(sep, n):
    from sklearn.calibration import _sigmoid_calibration

    rng = _rng()
    y = rng.random(n) < 0.3
    y[:2] = [True, False]
    f = rng.normal(size=n) * rng.uniform(0.5, 3) + sep * y + rng.normal()
    ours = fit_platt(f, y)
    a, b = _sigmoid_calibration(f, y)  # sklearn: p = 1 / (1 + exp(a f + b)), the opposite sign
    assert ours.converged
    assert np.isclose(ours.a, -a, rtol=1e-3, atol=1e-6) and np.isclose(ours.b, -b, rtol=1e-3, atol=1e-6)


def test_platt_at_the_optimum_within_rounding_is_converged():
    """n = 3000, seed 42: the gradient stays above tol (5e-5 > 1e-5) at an optimum the line search cannot
    improve in fp64; this fit used to report NOT converged while agreeing with scikit-learn to 1e-8."""
    from sklearn.calibration import _sigmoid_calibration

    rng = np.random.default_rng(42)
    y = rng.random(3000) < 0.3
    y[:2] = [True, False]
    f = rng.normal(size=3000) * rng.uniform(0.5, 3) + 0.7 * y + rng.normal()
    ours = fit_platt(f, y)
    a, b = _sigmoid_calibration(f, y)
    assert ours.converged and np.isclose(ours.a, -a, rtol=1e-6) and np.isclose(ours.b, -b, rtol=1e-6)


def test_platt_needs_both_classes():
    with pytest.raises(ValueError, match="both classes"):
        fit_platt(np.zeros(5), np.ones(5))


def test_metrics_against_sklearn():
    from sklearn.metrics import brier_score_loss, roc_auc_score
    from sklearn.metrics import log_loss as sk_log_loss

    rng = _rng()
    y = rng.random(500) < 0.4
    p = np.clip(rng.random(500) * 0.6 + 0.4 * y, 0, 1)
    p[:20] = np.round(p[:20], 1)  # ties
    assert np.isclose(log_loss(p, y), sk_log_loss(y, p))
    assert np.isclose(brier(p, y), brier_score_loss(y, p))
    assert np.isclose(roc_auc(p, y), roc_auc_score(y, p))
    assert ece(np.full(10, 0.3), np.array([1, 1, 1] + [0] * 7)) == pytest.approx(0.0)
    assert ece(np.full(10, 0.9), np.zeros(10)) == pytest.approx(0.9)


def test_labels():
    y, bad = parse_labels([0, 1, True, "false", " Violation", "compliant", "maybe", None, 2],
                          " Compliant", " Violation")
    assert y[:6] == [0, 1, 1, 0, 1, 0] and y[6:] == [None, None, None]
    assert [i for i, _ in bad] == [6, 7, 8]


def test_a_policys_own_labels_come_before_the_words_they_invert():
    """A policy asking "is this safe?" answers " Yes" for compliant: its own strings decide, "yes" is compliant and
    "no" a violation, the other words keep their meaning, and a note says so; labels that invert nothing get none."""
    y, bad = parse_labels(["Yes", " no", "YES", "true", 0, "violation"], " Yes", " No")
    assert y == [0, 1, 0, 1, 0, 1] and not bad
    note = label_words_note("safe", " Yes", " No")
    assert "labels read 'yes' as compliant and 'no' as violation" in note
    assert label_words_note("pii", " Compliant", " Violation") is None
    assert label_words_note("guard", " No", " Yes") is None  # yes/no in their usual sense


def test_calibrate_cli_dry_run_then_write(tmp_path, sample_slice):
    """On the first 80 labeled rows (conftest.py): enough of each class to fit, a fifth of the scoring."""
    labeled = sample_slice["labeled"]
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    before = (bundle / "policy.json").read_text()
    res = CliRunner().invoke(cli, ["calibrate", str(labeled), "--policy", str(bundle),
                                   "--label-column", "pii", "--dry-run", "--plot", str(tmp_path / "r.png")])
    assert res.exit_code == 0, res.output
    assert "roc_auc" in res.output and (tmp_path / "r.png").stat().st_size > 1000
    assert (bundle / "policy.json").read_text() == before
    res = CliRunner().invoke(cli, ["calibrate", str(labeled), "--policy", str(bundle),
                                   "--label-column", "pii"])
    assert res.exit_code == 0, res.output
    cal = json.loads((bundle / "policy.json").read_text())["calibration"]
    assert {"a", "b", "data_sha256", "rows", "date", "metrics_after"} <= set(cal)
    assert cal["rows"] == pq.read_table(labeled).num_rows


def test_calibrate_from_scores_matches_scoring(tmp_path, sample_slice):
    labeled = sample_slice["labeled"]
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    scores = tmp_path / "s.parquet"
    res = CliRunner().invoke(cli, ["score", str(labeled), "--policies", str(bundle),
                                   "--raw", "--keep", "pii", "-o", str(scores), "--no-progress"])
    assert res.exit_code == 0, res.output
    a = CliRunner().invoke(cli, ["calibrate", str(scores), "--policy", str(bundle), "--from-scores", "--dry-run",
                                 "--label-column", "pii"])
    b = CliRunner().invoke(cli, ["calibrate", str(labeled), "--policy", str(bundle),
                                 "--label-column", "pii", "--dry-run"])
    assert a.exit_code == b.exit_code == 0, a.output + b.output
    assert a.output.splitlines()[0] == b.output.splitlines()[0]  # same a, b from either route
    assert "holds no score output's metadata" not in a.output  # its metadata traces the scores to the policy


def test_scores_of_another_adapter_or_not_finite_are_refused(tmp_path, sample_slice):
    """--from-scores reads f that the output's metadata must trace to this policy (adapter, prompt, labels); a file
    without metadata is read with a note; a score that is not finite is refused, not counted below every threshold."""
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    scores = tmp_path / "s.parquet"
    run("score", sample_slice["labeled"], "--policies", bundle, "--raw", "--keep", "pii", "-o", scores,
        "--no-progress")
    prompt_only = shutil.copytree(bundle, tmp_path / "p" / "pii")
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (prompt_only / f).unlink()
    for command in ("calibrate", "evaluate"):
        res = CliRunner().invoke(cli, [command, str(scores), "--policy", str(prompt_only), "--from-scores",
                                       "--label-column", "pii", "--dry-run"][:None if command == "calibrate" else -1])
        assert res.exit_code == 1 and "scored with another adapter of policy 'pii'" in res.output, res.output
    t = pq.read_table(scores)
    f = t.column("f_pii").to_pylist()
    f[4] = float("nan")
    bare = tmp_path / "bare.parquet"
    pq.write_table(t.set_column(t.column_names.index("f_pii"), "f_pii", pa.array(f)), bare)
    res = CliRunner().invoke(cli, ["evaluate", str(bare), "--policy", str(bundle), "--from-scores",
                                   "--label-column", "pii"])
    assert res.exit_code == 1 and "bare.parquet, row 4 (id" in res.output and "its f_pii is nan, not a finite score" \
        in res.output, res.output
    pq.write_table(t, bare)  # the same rows without the metadata
    res = run("evaluate", bare, "--policy", bundle, "--from-scores", "--label-column", "pii", "--bootstrap", 0)
    assert "bare.parquet holds no score output's metadata" in " ".join(res.output.split())


def test_calibrate_reports_bad_labels(tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    t = pq.read_table(SAMPLE / "labeled.parquet").slice(0, 60)
    labels = [str(v) for v in t.column("pii").to_pylist()]
    labels[3] = "unsure"
    pq.write_table(t.append_column("verdict", pa.array(labels)), tmp_path / "l.parquet")
    res = CliRunner().invoke(cli, ["calibrate", str(tmp_path / "l.parquet"), "--policy", str(bundle),
                                   "--label-column", "verdict", "--dry-run", "--holdout", "0"])
    assert res.exit_code == 0, res.output
    assert "1 rows have no usable label" in res.output and "row 3" in res.output


def test_calibrate_from_long_layout_scores(tmp_path, sample_slice):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    scores = tmp_path / "s.jsonl"
    res = CliRunner().invoke(cli, ["score", str(sample_slice["labeled"]), "--policies", str(bundle), "--raw",
                                   "--keep", "pii", "--layout", "long", "--format", "jsonl", "-o", str(scores),
                                   "--no-progress"])
    assert res.exit_code == 0, res.output
    res = CliRunner().invoke(cli, ["calibrate", str(scores), "--policy", str(bundle), "--from-scores",
                                   "--label-column", "pii", "--dry-run"])
    assert res.exit_code == 0 and "a = " in res.output, res.output


def test_calibrate_names_a_labeled_row_the_tokenizer_drops(tmp_path):
    """Every labeled row must be scored: one that encodes to nothing stops the fit, naming its file and row."""
    from policyscan.calibration.labeled import score_labeled
    from policyscan.engine.errors import InputError
    from policyscan.engine.inputs.sources import ReadSpec
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    engine = Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"])[:1], EngineSettings("cpu", max_length=256))
    real = engine.encoder.encode_batch
    engine.encoder.encode_batch = lambda texts: [[] if "VANISH" in t else ids for t, ids in zip(texts, real(texts))]
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t, "label": "Compliant"}) + "\n" for i, t in
                           enumerate(["hello there", "my card number is 4111", "VANISH"])))
    with pytest.raises(InputError, match=r"l\.jsonl, row 2: the conversation encodes to no tokens"):
        score_labeled(engine, [src], ReadSpec(), "label")
    with pytest.raises(ValueError, match="conversation 1 encodes to no tokens"):
        engine.score_conversations([np.array([5, 6]), np.array([], dtype=np.int64)])


def test_scores_an_older_policyscan_kept_from_the_input_are_refused(tmp_path, sample_slice):
    """Before --keep refused the names of score columns, an input's own f_pii could be kept into an output: its
    metadata lists it under read.keep, and --from-scores refuses to take it for the policy's scores."""
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    out = tmp_path / "s.parquet"
    run("score", sample_slice["labeled"], "--policies", bundle, "--keep", "pii", "-o", out, "--no-progress")
    t = pq.read_table(out)
    kv = pq.ParquetFile(out).metadata.metadata
    meta = json.loads(kv[b"policyscan"])
    meta["read"]["keep"] = ["pii", "f_pii"]
    forged = t.append_column("f_pii", pa.array(np.zeros(t.num_rows)))
    with pq.ParquetWriter(out, forged.schema) as w:
        w.write_table(forged)
        w.add_key_value_metadata({b"policyscan": json.dumps(meta).encode()})
    res = CliRunner().invoke(cli, ["calibrate", str(out), "--policy", str(bundle), "--from-scores",
                                   "--label-column", "pii", "--dry-run"])
    assert res.exit_code == 1 and "its column 'f_pii' is an input column kept with --keep" in res.output, res.output
