"""policyscan evaluate as a user runs it: figures against scikit-learn on the scores `score` gives the same rows,
thresholds for a target written (or not) into policy.json, undefined metrics as null, FP8 beside bf16."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE, run
from click.testing import CliRunner
from sklearn import metrics as skm

from policyscan.cli.main import cli
from policyscan.engine.policy.bundle import load_policy

FLIP_EVERY = 7  # label noise, so that the figures are not all 1.0


@pytest.fixture(scope="module")
def noisy(tmp_path_factory, sample_slice):
    """The labeled slice with every 7th label of each policy flipped, and `score --raw` of it (the same rows)."""
    root = tmp_path_factory.mktemp("evaluate")
    t = pq.read_table(sample_slice["labeled"])
    for col in ("pii", "investment_advice"):
        v = np.array(t.column(col).to_pylist())
        v[::FLIP_EVERY] = 1 - v[::FLIP_EVERY]
        t = t.set_column(t.schema.get_field_index(col), col, pa.array(v))
    labeled = root / "noisy.parquet"
    pq.write_table(t, labeled)
    scores = root / "noisy.scores.parquet"
    run("score", labeled, "-o", scores, "--raw", "--keep", "pii", "--keep", "investment_advice", "--no-progress")
    return {"labeled": labeled, "scores": scores, "root": root}


def _strict_json(path) -> dict:
    def refuse(name):
        raise AssertionError(f"{name} in JSON")
    return json.loads(path.read_text(), parse_constant=refuse)


def test_figures_agree_with_sklearn_and_the_from_scores_route(noisy, tmp_path):
    pols = [SAMPLE / "policies" / "pii", SAMPLE / "policies" / "investment_advice"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    res = run("evaluate", noisy["labeled"], "--policy", pols[0], "--policy", pols[1], "--json", a, "--bootstrap", 50)
    assert "policy pii: 80 labeled rows" in res.output and "95% interval" in res.output
    assert "threshold  flagged  precision" in res.output
    run("evaluate", noisy["scores"], "--policy", pols[0], "--policy", pols[1], "--from-scores", "--json", b,
        "--bootstrap", 50)
    scored, read = _strict_json(a), _strict_json(b)
    t = pq.read_table(noisy["scores"])
    for name in ("pii", "investment_advice"):
        got = scored["policies"][name]
        p, y = np.array(t.column(f"p_{name}").to_pylist()), np.array(t.column(name).to_pylist()).astype(bool)
        pred = p >= got["threshold"]
        assert got["rows"] == 80 and got["violations"] == int(y.sum())
        assert got["roc_auc"] == pytest.approx(skm.roc_auc_score(y, p), abs=1e-9)
        assert got["pr_auc"] == pytest.approx(skm.average_precision_score(y, p), abs=1e-9)
        assert got["log_loss"] == pytest.approx(skm.log_loss(y, p), abs=1e-9)
        assert got["brier"] == pytest.approx(skm.brier_score_loss(y, p), abs=1e-12)
        assert got["precision"] == pytest.approx(skm.precision_score(y, pred), abs=1e-12)
        assert got["recall"] == pytest.approx(skm.recall_score(y, pred), abs=1e-12)
        assert got["f1"] == pytest.approx(skm.f1_score(y, pred), abs=1e-12)
        tn, fp, fn, tp = skm.confusion_matrix(y, pred).ravel()
        assert got["confusion"] == {"tp": tp, "fp": fp, "fn": fn, "tn": tn}
        lo, hi = got["intervals"]["roc_auc"]
        assert lo <= got["roc_auc"] <= hi
        assert len(got["sweep"]) == 19 + (got["threshold"] not in [round(0.05 * k, 2) for k in range(1, 20)])
        for k in ("roc_auc", "pr_auc", "log_loss", "brier", "ece", "precision", "recall", "f1", "intervals", "sweep"):
            assert read["policies"][name][k] == pytest.approx(got[k]) if not isinstance(got[k], (dict, list)) \
                else read["policies"][name][k] == got[k], k
    assert len(scored["model"]["sha256"]) == 64 and scored["device"] == "cpu" and read["model"] is None


def test_a_target_threshold_is_written_only_with_write(noisy, tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    before = (bundle / "policy.json").read_text()
    res = run("evaluate", noisy["scores"], "--policy", bundle, "--from-scores", "--target-recall", "0.8",
              "--bootstrap", 0)
    assert "recall >= 0.8: threshold" in res.output and "gives precision" in res.output
    assert (bundle / "policy.json").read_text() == before
    page = tmp_path / "e.html"
    res = run("evaluate", noisy["scores"], "--policy", bundle, "--from-scores", "--target-recall", "0.8", "--write",
              "--bootstrap", 0, "-o", page)
    meta = json.loads((bundle / "policy.json").read_text())
    choice = meta["threshold_choice"]
    assert choice["target"] == "recall" and choice["value"] == 0.8 and choice["achieved"]["recall"] >= 0.8
    assert choice["replaced"] == 0.5 and choice["rows"] == 80 and len(choice["data_sha256"]) == 64
    assert choice["calibration"] == {"a": meta["calibration"]["a"], "b": meta["calibration"]["b"]}
    assert load_policy(bundle).threshold == meta["threshold"] != 0.5
    assert f"updated {bundle / 'policy.json'}" in res.output
    html = page.read_text()
    assert "ROC curve" in html and "precision-recall curve" in html and "reliability" in html
    assert "written to" in html


def _scores_file(path, f, labels) -> None:
    path.write_text("".join(json.dumps({"id": f"r{i}", "f_pii": float(v), "label": lab}) + "\n"
                            for i, (v, lab) in enumerate(zip(f, labels))))


def test_an_unmet_target_writes_nothing(tmp_path):
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    before = (bundle / "policy.json").read_text()
    src = tmp_path / "s.jsonl"
    _scores_file(src, [5.0, 4.0, 3.0, -2.0, -3.0], [0, 1, 1, 0, 0])  # the highest row is compliant
    res = CliRunner().invoke(cli, ["evaluate", str(src), "--policy", str(bundle), "--from-scores",
                                   "--target-precision", "0.9", "--write"])
    assert res.exit_code == 1 and "no policy.json was changed" in res.output
    assert "no threshold reaches precision 0.9" in res.output
    assert (bundle / "policy.json").read_text() == before


def test_one_class_gives_null_metrics_with_the_reason(tmp_path):
    src, out = tmp_path / "s.jsonl", tmp_path / "e.json"
    _scores_file(src, [-3.0, -2.5, 1.0, -4.0], ["compliant", "no", 0, False])
    res = run("evaluate", src, "--policy", SAMPLE / "policies" / "pii", "--from-scores", "--json", out,
              "--bootstrap", 20)
    got = _strict_json(out)["policies"]["pii"]
    assert got["roc_auc"] is None and got["pr_auc"] is None and got["recall"] is None
    assert got["undefined"]["roc_auc"] == "no violations among the labeled rows"
    assert got["false_positive_rate"] == 0.25 and got["log_loss"] is not None
    assert "roc_auc is undefined (no violations among the labeled rows); recorded as null" in res.output


def test_usage_errors(tmp_path, noisy):
    pol = str(SAMPLE / "policies" / "pii")
    for args, msg in ((["--target-recall", "0.9", "--max-f1"], "give one of"),
                      (["--write"], "--write records a chosen threshold"),
                      (["--target-recall", "0"], "met by any threshold"),
                      (["--target-recall", "nan"], "not a number"),
                      (["--json", str(noisy["scores"])], "would destroy it")):
        res = CliRunner().invoke(cli, ["evaluate", str(noisy["scores"]), "--policy", pol, "--from-scores", *args])
        assert res.exit_code == 2 and msg in res.output, (args, res.output)


def test_fp8_is_shown_beside_bf16(tmp_path, sample_slice):
    """On the CPU, --precision fp8 runs the GPU's W8A8 arithmetic in torch twins: the bf16 column and the rows whose
    verdict moved come with it."""
    labeled = tmp_path / "l.parquet"
    pq.write_table(pq.read_table(sample_slice["labeled"]).slice(0, 24), labeled)
    out, page = tmp_path / "e.json", tmp_path / "e.html"
    res = run("evaluate", labeled, "--policy", SAMPLE / "policies" / "pii", "--precision", "fp8", "--json", out,
              "--bootstrap", 10, "--max-length", "512", "-o", page)
    assert 'data-precision="bf16"' in page.read_text() and "FP8 and bf16 verdicts differ on" in page.read_text()
    got = _strict_json(out)
    assert got["precision"] == "fp8"
    pii = got["policies"]["pii"]
    assert pii["bf16"]["rows"] == pii["rows"] == 24 and pii["bf16"]["roc_auc"] is not None
    assert {"rows", "share", "max_abs_dp", "examples"} <= set(pii["verdicts_differ"])
    assert "bf16" in res.output.splitlines()[1] and "FP8 and bf16 verdicts differ on" in res.output


def test_rows_naming_other_policies_are_counted_in_a_note(tmp_path):
    """A file with a `policy` column gives each policy the rows that name it; the rest are left out, and a note
    counts them by name, so a misspelt policy ('PII') shows. The column is found though the first line lacks it."""
    rows = [{"id": "x", "text": "user: hello", "label": 0}]
    rows += [{"id": f"r{i}", "text": f"user: my phone is 555-01{i:02d}", "label": 1,
              "policy": ["pii", "PII", "investment_advice"][i % 3]} for i in range(9)]
    src = tmp_path / "l.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    res = run("evaluate", src, "--policy", SAMPLE / "policies" / "pii", "--bootstrap", 0, "--max-length", 128)
    assert "pii: 7 labeled rows name no policy of this run in their 'policy' column and are left out ('PII' 3, " \
           "'investment_advice' 3, 'null' 1)" in " ".join(res.output.split())
    assert "policy pii: 3 labeled rows" in res.output
    both = run("evaluate", src, "--policy", SAMPLE / "policies" / "pii", "--policy",
               SAMPLE / "policies" / "investment_advice", "--bootstrap", 0, "--max-length", 128).output
    assert "4 labeled rows name no policy of this run" in " ".join(both.split()) and "'investment_advice' 3" not in both
