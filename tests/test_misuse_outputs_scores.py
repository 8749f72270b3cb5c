"""Nothing silently wrong in what `score` writes and `verify` concludes (non-finite weights and scores,
tokenizer and template edits, duplicate ids, paths from elsewhere), exit codes as documented, and the flagged_
and truncated_ columns."""
from __future__ import annotations

import gzip
import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from cli_cases import SAMPLE
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from policyscan.cli.main import cli
from policyscan.engine.outputs.sinks import read_metadata


def _log(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in rows))
    return path


def _cli(*args):
    return CliRunner().invoke(cli, [str(a) for a in args])


def _score(*args):
    return _cli("score", *args, "--no-progress", "--max-length", "256")


ROWS = [("a", "hello there"), ("b", "my neighbour's phone is 555-0199"), ("c", "what is a bond?")]


def test_non_finite_adapter_weights_refuse_the_policy(tmp_path):
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    tensors = load_file(pol / "adapter_model.safetensors")
    name = sorted(tensors)[3]
    tensors[name].view(-1)[5] = float("nan")
    save_file(tensors, pol / "adapter_model.safetensors")
    res = _score(_log(tmp_path / "l.jsonl", ROWS), "-o", tmp_path / "o.parquet", "--policies", pol)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "adapter_model.safetensors" in res.output and name in res.output and "non-finite" in res.output
    assert not (tmp_path / "o.parquet").exists()


def test_a_row_whose_f_is_not_finite_goes_to_the_errors_file(tmp_path, monkeypatch):
    from policyscan.engine.run import runner

    real = runner.Engine.score_conversations

    def overflowing(self, convs):
        f, tokens, truncated = real(self, convs)
        f[1, 0], f[2, 1] = np.nan, np.inf
        return f, tokens, truncated

    monkeypatch.setattr(runner.Engine, "score_conversations", overflowing)
    out = tmp_path / "o.parquet"
    res = _score(_log(tmp_path / "l.jsonl", ROWS), "-o", out, "--raw")
    assert res.exit_code == 3, res.output
    t = pq.read_table(out)
    assert t.column("id").to_pylist() == ["a"]
    assert all(np.isfinite(t.column(c).to_numpy()).all() for c in t.column_names if c != "id")
    errs = [json.loads(x) for x in (tmp_path / "o.parquet.errors.jsonl").read_text().splitlines()]
    assert [(e["id"], e["line"]) for e in errs] == [("b", 2), ("c", 3)]
    assert "f is not finite (investment_advice nan)" in errs[0]["reason"] and "pii inf" in errs[1]["reason"]
    assert "rows in 3 = scored 1 + in errors 2 (balanced)" in res.output


def test_tokenizer_and_template_edits_make_outputs_stale_and_verify_exit_1(tmp_path):
    model = shutil.copytree(SAMPLE / "model", tmp_path / "m")
    arch = tmp_path / "arch"
    arch.mkdir()
    _log(arch / "d1.jsonl", ROWS)
    outdir = tmp_path / "scores"
    assert _score(arch, "-o", f"{outdir}/", "--model", model).exit_code == 0
    out = outdir / "d1.scores.parquet"
    assert "model.safetensors" in read_metadata(out)["model_files"]
    assert "up to date" in _score(arch, "-o", outdir, "--model", model).output
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    res = _cli("verify", out)
    assert res.exit_code == 1 and "chat_template.jinja" in res.output, res.output
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 77}))
    res = _score(arch, "-o", outdir, "--model", model)
    assert res.exit_code == 0 and "up to date" not in res.output
    assert _cli("verify", out).exit_code == 0
    tensors = load_file(model / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] * 1.01
    save_file(tensors, model / "model.safetensors")
    res = _cli("verify", out)
    assert res.exit_code == 1 and "model.safetensors" in res.output, res.output


def test_duplicate_ids_are_counted_and_verify_matches_them(tmp_path):
    src = _log(tmp_path / "l.jsonl", ROWS + [("a", "a different text with the same id"), ("b", ROWS[1][1])])
    out = tmp_path / "o.parquet"
    res = _score(src, "-o", out)
    assert res.exit_code == 0 and "duplicate ids: 2 scored rows" in res.output, res.output
    assert read_metadata(out)["accounting"]["duplicate_ids"] == 2
    res = _cli("verify", out)
    assert res.exit_code == 0 and "verified 5 rows (3 ids)" in res.output, res.output


def test_verify_from_another_directory_and_after_a_move(tmp_path, monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    _log(work / "l.jsonl", ROWS)
    monkeypatch.chdir(work)
    assert _score("l.jsonl", "-o", "o.jsonl.gz").exit_code == 0  # relative paths as typed
    rec = json.loads(Path("o.jsonl.gz.meta.json").read_text())["inputs"][0]
    assert rec["path"] == "l.jsonl" and Path(rec["abs_path"]).is_absolute() and rec["rel_path"] == "l.jsonl"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    assert _cli("verify", work / "o.jsonl.gz").exit_code == 0
    moved = shutil.move(str(work), str(tmp_path / "moved"))
    res = _cli("verify", Path(moved) / "o.jsonl.gz")
    assert res.exit_code == 0 and "all reproduced" in res.output, res.output


def test_output_folder_problems_are_usage_errors_before_scoring(tmp_path, monkeypatch):
    from policyscan.cli import common
    from policyscan.engine.run import runner

    monkeypatch.setattr(runner.Engine, "__init__", lambda *a, **k: (_ for _ in ()).throw(AssertionError("loaded")))
    src = _log(tmp_path / "l.jsonl", ROWS)
    res = _score(src, "-o", tmp_path / "missing" / "o.parquet")
    assert res.exit_code == 2 and "does not exist" in res.output
    monkeypatch.setattr(common.os, "access", lambda *a, **k: False)
    res = _score(src, "-o", tmp_path / "o.parquet")
    assert res.exit_code == 2 and "is not writable" in res.output


def test_the_output_suffix_sets_the_format(tmp_path):
    src = _log(tmp_path / "l.jsonl", ROWS)
    assert _score(src, "-o", tmp_path / "x.jsonl").exit_code == 0
    assert [json.loads(x)["id"] for x in (tmp_path / "x.jsonl").read_text().splitlines()] == ["a", "b", "c"]
    assert _score(src, "-o", tmp_path / "x.jsonl.gz").exit_code == 0
    assert len(gzip.open(tmp_path / "x.jsonl.gz", "rt").read().splitlines()) == 3
    res = _score(src, "-o", tmp_path / "y.jsonl", "--format", "parquet")
    assert res.exit_code == 2 and "disagrees" in res.output
    res = _score(src, "-o", tmp_path / "y.csv")
    assert res.exit_code == 2 and ".parquet" in res.output
    assert not (tmp_path / "y.jsonl").exists() and not (tmp_path / "y.csv").exists()


def test_plot_without_matplotlib_is_one_line(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    res = _cli("calibrate", SAMPLE / "labeled.parquet", "--policy", bundle, "--plot", tmp_path / "r.png")
    assert res.exit_code == 1 and "--plot needs matplotlib" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1


def test_flagged_and_truncated_columns(tmp_path):
    long_text = "user: " + "tell me about bonds and stocks please. " * 60
    src = _log(tmp_path / "l.jsonl", ROWS + [("d", long_text)])
    out = tmp_path / "o.parquet"
    res = _score(src, "-o", out, "--flagged", "--mark-truncated")
    assert res.exit_code == 0, res.output
    t = pq.read_table(out)
    for name in ("pii", "investment_advice"):
        p = t.column(f"p_{name}").to_numpy()
        threshold = json.loads((SAMPLE / "policies" / name / "policy.json").read_text())["threshold"]
        assert t.column(f"flagged_{name}").to_pylist() == (p >= threshold).tolist()
    assert t.column("truncated").to_pylist() == [False, False, False, True]
    long_out = tmp_path / "long.parquet"
    assert _score(src, "-o", long_out, "--flagged", "--mark-truncated", "--layout", "long").exit_code == 0
    lt = pq.read_table(long_out)
    assert lt.column_names == ["id", "policy", "p", "flagged", "truncated"]
    assert lt.column("truncated").to_pylist() == [False] * 6 + [True] * 2


def test_progress_bar_has_a_total_for_parquet(tmp_path, monkeypatch):
    from policyscan.cli import score as score_cmd

    monkeypatch.setattr(score_cmd, "_is_terminal", lambda: True)
    src = tmp_path / "l.parquet"
    pq.write_table(pa.table({"id": [i for i, _ in ROWS], "text": [t for _, t in ROWS]}), src)
    res = CliRunner().invoke(cli, ["score", str(src), "-o", str(tmp_path / "o.parquet"), "--max-length", "256"])
    assert res.exit_code == 0 and "3/3" in res.output and "100%" in res.output, res.output
