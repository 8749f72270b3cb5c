"""policyscan score / inspect / quantize / verify as a user runs them, on the bundled sample model and policies:
outputs, layouts, resuming, reproducibility. What goes wrong is in test_cli_failures.py.

Scoring tests read `sample_slice` (conftest.py): the sample's first 40 conversations, as Parquet and JSONL."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import MSG, SAMPLE, run
from click.testing import CliRunner

from policyscan.cli.main import cli
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.outputs import run_output
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.run import pipeline


def test_sample_parquet_wide_with_metadata(tmp_path, sample_slice):
    out = tmp_path / "s.parquet"
    n = sample_slice["rows"]
    res = run("score", sample_slice["parquet"], "-o", out, "--raw", "--no-progress")
    t = pq.read_table(out)
    assert t.column_names == ["id", "p_investment_advice", "p_pii", "f_investment_advice", "f_pii"]
    src = pq.read_table(sample_slice["parquet"])
    assert t.column("id").to_pylist() == src.column("id").to_pylist()  # input order
    meta = read_metadata(out)
    acc = meta["accounting"]
    assert acc["rows_in"] == acc["rows_scored"] == n and acc["balanced"]
    assert {p["name"] for p in meta["policies"]} == {"pii", "investment_advice"}
    assert meta["model"]["sha256"] == Checkpoint.open(SAMPLE / "model").fingerprint()  # hashed in a thread
    assert meta["inputs"][0]["sha256"]
    assert f"rows in {n} = scored {n} + in errors 0 (balanced)" in res.output
    # the scoring window's parts: what waited for the reader and what the writing took, within the whole
    assert 0 <= acc["input_wait_seconds"] + acc["output_seconds"] <= acc["seconds"]
    assert re.search(r"in [\d.]+ s \([\d,]+ tokens/s; waiting for input [\d.]+ s, writing [\d.]+ s\)", res.output)
    assert meta["settings"]["cuda_graphs"] is True
    assert not list(tmp_path.glob(".*tmp*"))
    assert not (tmp_path / "s.parquet.errors.jsonl").exists()


def test_no_cuda_graphs_is_recorded_and_scores_the_same(tmp_path, sample_slice):
    """The escape hatch: accepted everywhere (the CPU has no graphs), recorded, same numbers."""
    a, b = tmp_path / "a.parquet", tmp_path / "b.parquet"
    run("score", sample_slice["parquet"], "-o", a, "--raw", "--no-progress", "--max-length", "256")
    run("score", sample_slice["parquet"], "-o", b, "--raw", "--no-progress", "--max-length", "256",
        "--no-cuda-graphs")
    assert read_metadata(b)["settings"]["cuda_graphs"] is False
    assert pq.read_table(a).equals(pq.read_table(b))


def test_jsonl_long_layout_keep_and_errors(tmp_path):
    src = tmp_path / "in.jsonl"
    recs = [{"id": "a", "messages": MSG, "team": "x"}, {"id": "b", "messages": None, "team": "y"},
            "{broken", {"id": "d", "messages": MSG[:1], "team": 3}]
    src.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in recs) + "\n")
    out = tmp_path / "o.jsonl"
    res = run("score", src, "-o", out, "--format", "jsonl", "--layout", "long", "--keep", "team", "--no-progress",
              ok=(3,))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["id"], r["policy"]) for r in lines] == [("a", "investment_advice"), ("a", "pii"),
                                                      ("d", "investment_advice"), ("d", "pii")]
    assert lines[0]["team"] == "x" and lines[2]["team"] == "3"
    errs = [json.loads(x) for x in (tmp_path / "o.jsonl.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["id"]) for e in errs] == [(2, "b"), (3, "in.jsonl:3")]
    assert "null conversation" in errs[0]["reason"] and "malformed JSON" in errs[1]["reason"]
    meta = json.loads((tmp_path / "o.jsonl.meta.json").read_text())
    assert meta["accounting"]["rows_in"] == 4 and meta["accounting"]["rows_in_errors"] == 2
    assert "rows in 4 = scored 2 + in errors 2 (balanced)" in res.output
    pii = [r["p"] for r in lines if r["policy"] == "pii"]
    assert pii[0] > 0.5 > pii[1]  # the assistant disclosed personal data; "d" is the user's opening line only


def test_output_dir_skips_up_to_date_inputs(tmp_path):
    arch = tmp_path / "archive"
    arch.mkdir()
    for day in ("d1", "d2"):
        pq.write_table(pa.table({"id": [day], "text": [f"hello from {day}"]}), arch / f"{day}.parquet")
    outdir = tmp_path / "scores"
    run("score", arch, "-o", f"{outdir}/", "--no-progress")
    assert sorted(p.name for p in outdir.iterdir()) == ["d1.scores.parquet", "d2.scores.parquet"]
    pq.write_table(pa.table({"id": ["d3"], "text": ["new day"]}), arch / "d3.parquet")
    res = run("score", arch, "-o", outdir, "--no-progress")
    assert res.output.count("up to date") == 2 and "wrote" in res.output and "d3.scores.parquet" in res.output
    res = run("score", arch, "-o", outdir, "--no-progress", "--raw")  # other settings: everything again
    assert "up to date" not in res.output
    with pytest.MonkeyPatch.context() as m:  # a policyscan whose scores can differ: everything again
        m.setattr(run_output, "SCORING_REVISION", run_output.SCORING_REVISION + 1)
        assert "up to date" not in run("score", arch, "-o", outdir, "--no-progress", "--raw").output


def test_output_dir_keeps_the_archives_folders(tmp_path):
    """A partitioned archive (the same file name in every day's folder, as Spark writes it): each file's output
    sits at its place below the folder or glob given, and the next run finds every one up to date. Names that
    would still share an output stop the run before anything is scored, naming them."""
    arch = tmp_path / "archive"
    for day in ("day=1", "day=2"):
        (arch / day).mkdir(parents=True)
        pq.write_table(pa.table({"id": [day], "text": [f"hello from {day}"]}), arch / day / "part-0.parquet")
    pq.write_table(pa.table({"id": ["top"], "text": ["at the top"]}), arch / "top.parquet")
    out = tmp_path / "scores"
    run("score", arch, "-o", f"{out}/", "--no-progress")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.scores.parquet")) == [
        "day=1/part-0.scores.parquet", "day=2/part-0.scores.parquet", "top.scores.parquet"]
    assert read_metadata(out / "day=2" / "part-0.scores.parquet")["inputs"][0]["path"].endswith("day=2/part-0.parquet")
    assert pq.read_table(out / "day=1" / "part-0.scores.parquet")["id"].to_pylist() == ["day=1"]
    assert run("score", arch, "-o", out, "--no-progress").output.count("up to date") == 3
    res = run("score", str(arch / "*" / "part-0.parquet"), "-o", f"{tmp_path / 'glob'}/", "--no-progress")
    assert (tmp_path / "glob" / "day=1" / "part-0.scores.parquet").is_file(), res.output
    res = run("score", arch / "day=1" / "part-0.parquet", arch / "day=2" / "part-0.parquet", "-o",
              f"{tmp_path / 'flat'}/", "--no-progress", ok=(1,))
    assert "inputs of the same name would share an output" in res.output and "part-0.scores.parquet" in res.output
    assert not (tmp_path / "flat").exists() or not list((tmp_path / "flat").iterdir())


def test_a_refused_output_dir_run_leaves_no_folders(tmp_path):
    """-o DIR/'s folders are made once every check has passed: a run refused after the outputs were planned (here
    --text-is-rendered on a messages column) makes none, and a folder that would have to be made through a file is
    refused before anything is scored."""
    arch = tmp_path / "archive" / "day=1"
    arch.mkdir(parents=True)
    (arch / "chats.jsonl").write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "scores"
    res = run("score", tmp_path / "archive", "-o", f"{out}/", "--text-is-rendered", "--chat-template", "plain",
              "--no-progress", ok=(2,))
    assert "--text-is-rendered" in res.output and not out.exists()
    (tmp_path / "afile").write_text("x")
    res = run("score", tmp_path / "archive", "-o", f"{tmp_path / 'afile' / 'sub'}/", "--chat-template", "plain",
              "--no-progress", ok=(2,))
    assert f"{tmp_path / 'afile'} is not a folder" in " ".join(res.output.split())
    run("score", tmp_path / "archive", "-o", f"{out}/", "--chat-template", "plain", "--no-progress")
    assert (out / "day=1" / "chats.scores.parquet").is_file()


def test_output_dir_scores_a_new_output_before_the_model_hash(tmp_path, monkeypatch):
    """-o DIR: a file without an output is scored while the model is still being hashed (the run key, which
    needs the hash, is taken when the output is written); the next run finds it up to date."""
    import threading

    scored, order = threading.Event(), []
    fingerprint, score_chunk = Checkpoint.fingerprint, pipeline.score_chunk

    def slow_fingerprint(self):
        scored.wait(60)  # a scoring that waited for the hash would wait here the whole minute
        order.append("hashed")
        return fingerprint(self)

    def first_chunk(*args, **kwargs):
        if not scored.is_set():
            order.append("scored")
            scored.set()
        return score_chunk(*args, **kwargs)

    monkeypatch.setattr(Checkpoint, "fingerprint", slow_fingerprint)
    monkeypatch.setattr(pipeline, "score_chunk", first_chunk)
    arch, outdir = tmp_path / "archive", tmp_path / "scores"
    arch.mkdir()
    pq.write_table(pa.table({"id": ["a"], "text": ["hello"]}), arch / "d1.parquet")
    run("score", arch, "-o", f"{outdir}/", "--no-progress")
    assert order[:2] == ["scored", "hashed"]
    meta = read_metadata(outdir / "d1.scores.parquet")
    assert meta["run_key"] and meta["model"]["sha256"] == fingerprint(Checkpoint.open(Path(meta["model"]["path"])))
    assert "up to date" in run("score", arch, "-o", outdir, "--no-progress").output


def test_inspect_and_quantize(tmp_path, sample_slice, monkeypatch):
    out = tmp_path / "s.parquet"
    run("score", sample_slice["parquet"], "-o", out, "--no-progress")
    assert json.loads(run("inspect", out).output)["accounting"]["balanced"] is True
    assert json.loads(run("inspect", SAMPLE / "policies" / "pii").output)["policy"] == "pii"
    assert json.loads(run("inspect", SAMPLE / "conversations.parquet").output)["rows"] == 200
    q = tmp_path / "fp8"
    run("quantize", SAMPLE / "model", q)
    assert json.loads(run("inspect", q).output)["fp8"] is True
    res = run("score", sample_slice["parquet"], "-o", tmp_path / "q.parquet", "--model", q, "--no-progress")
    assert "fp8" in res.output
    # the CPU run of an FP8 checkpoint under auto is fp32 on its dequantized weights, and verify repeats that
    for device in ([], ["--device", "auto"], ["--device", "cpu"]):
        assert "all reproduced bit for bit" in run("verify", tmp_path / "q.parquet", "--sample", 10, *device).output
    # an output from before the numerics were recorded, scored with a relative --model: verify repeats it too
    jl = tmp_path / "q.jsonl"
    with monkeypatch.context() as m:
        m.chdir(tmp_path)
        run("score", sample_slice["parquet"], "-o", jl, "--model", "fp8", "--no-progress")
    meta = json.loads(Path(f"{jl}.meta.json").read_text())
    del meta["numerics"]
    Path(f"{jl}.meta.json").write_text(json.dumps(meta))
    for device in ([], ["--device", "auto"]):
        assert "all reproduced bit for bit" in run("verify", jl, "--sample", 10, *device).output
    a = pq.read_table(out).column("p_pii").to_numpy()
    b = pq.read_table(tmp_path / "q.parquet").column("p_pii").to_numpy()
    assert abs(a - b).max() < 0.05
    shutil.rmtree(q)


def test_reproducible_and_order_independent(tmp_path, sample_slice):
    """The same file twice, rows shuffled, other batch sizes: bitwise the same p per id; verify agrees."""
    t = pq.read_table(sample_slice["parquet"])
    shuffled = tmp_path / "shuffled.parquet"
    pq.write_table(t.take(list(reversed(range(t.num_rows)))), shuffled)
    outs = []
    for i, (src, extra) in enumerate([(sample_slice["parquet"], []),
                                      (sample_slice["parquet"], []),
                                      (shuffled, ["--batch-tokens", "2048"])]):
        out = tmp_path / f"o{i}.parquet"
        run("score", src, "-o", out, "--no-progress", *extra)
        outs.append({r["id"]: (r["p_pii"], r["p_investment_advice"]) for r in pq.read_table(out).to_pylist()})
    assert outs[0] == outs[1] == outs[2]
    res = run("verify", tmp_path / "o2.parquet", "--sample", 20)
    assert "all reproduced bit for bit" in res.output


def _forge(out, edit):
    """The output with its table edited, its policyscan metadata kept."""
    t = pq.read_table(out)
    kv = pq.ParquetFile(out).metadata.metadata
    forged = edit(t)
    with pq.ParquetWriter(out, forged.schema) as w:
        w.write_table(forged)
        w.add_key_value_metadata({k: v for k, v in kv.items() if k == b"policyscan"})


def _set(t, column, row, value):
    values = t.column(column).to_pylist()
    values[row] = value
    return t.set_column(t.column_names.index(column), column, pa.array(values, t.schema.field(column).type))


def test_verify_reports_a_changed_row(tmp_path, sample_slice):
    out = tmp_path / "o.parquet"
    run("score", sample_slice["jsonl"], "-o", out, "--no-progress", "--raw")
    good = out.read_bytes()
    _forge(out, lambda t: _set(t, "p_pii", 5, 0.123))
    res = CliRunner().invoke(cli, ["verify", str(out), "--sample", "200"])
    assert res.exit_code == 4 and "1 differ" in res.output and "f_pii" not in res.output
    out.write_bytes(good)  # f is read by calibrate and evaluate --from-scores: verify compares it too
    _forge(out, lambda t: _set(t, "f_pii", 7, 5.0))
    res = CliRunner().invoke(cli, ["verify", str(out), "--sample", "200"])
    assert res.exit_code == 4 and "1 differ" in res.output and "f_pii: stored 5.0" in res.output


def test_an_output_that_lost_or_gained_rows_fails_verify_and_is_scored_again(tmp_path, sample_slice):
    """A sample of ids cannot see rows that are gone: the rows an output holds are counted against its metadata,
    by verify and by -o DIR/, which scores such an output again instead of skipping it."""
    src = tmp_path / "in" / "a.jsonl"
    src.parent.mkdir()
    src.write_bytes(sample_slice["jsonl"].read_bytes())
    out = tmp_path / "out" / "a.scores.parquet"
    run("score", src.parent, "-o", f"{out.parent}/", "--no-progress")
    rows = pq.ParquetFile(out).metadata.num_rows
    _forge(out, lambda t: t.slice(0, rows - 3))
    res = CliRunner().invoke(cli, ["verify", str(out)])
    assert res.exit_code == 4 and f"holds {rows - 3} rows where its metadata records {rows}" in res.output
    res = run("score", src.parent, "-o", f"{out.parent}/", "--no-progress")
    assert "up to date" not in res.output and pq.ParquetFile(out).metadata.num_rows == rows
    assert run("score", src.parent, "-o", f"{out.parent}/", "--no-progress").output.count("up to date") == 1


def test_many_chunks_and_two_inputs_into_one_output(tmp_path, sample_slice):
    """Chunked reading and writing keep every row, in order, across chunks and files."""
    from policyscan.engine.inputs.sources import ReadSpec
    from policyscan.engine.outputs.accounting import OutputSpec
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.pipeline import score_inputs
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    engine = Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"]), EngineSettings("cpu", batch_tokens=4096))
    out = tmp_path / "o.parquet"
    n = sample_slice["rows"]  # 40 rows a file: chunks of 7 end mid-file and a file's last chunk is short
    acc = score_inputs(engine, [sample_slice["parquet"], sample_slice["jsonl"]], out,
                       tmp_path / "e.jsonl", ReadSpec(chunk_rows=7), OutputSpec())
    ids = pq.read_table(out).column("id").to_pylist()
    src = pq.read_table(sample_slice["parquet"]).column("id").to_pylist()
    assert acc.balanced and acc.rows_scored == 2 * n and ids == src + src
    whole = tmp_path / "w.parquet"
    score_inputs(engine, [sample_slice["parquet"]], whole, tmp_path / "e2.jsonl", ReadSpec(), OutputSpec())
    assert pq.read_table(whole).to_pylist() == pq.read_table(out).slice(0, n).to_pylist()


def test_progress_bar_on_a_terminal(tmp_path, monkeypatch, sample_slice):
    from policyscan.cli import score as score_cmd

    monkeypatch.setattr(score_cmd, "_is_terminal", lambda: True)
    res = run("score", sample_slice["jsonl"], "-o", tmp_path / "o.parquet")
    assert f"{sample_slice['rows']} rows" in res.output and "tok/s" in res.output


def test_the_summary_says_which_policies_are_uncalibrated(tmp_path):
    """A policy.json without calibration scores p = sigmoid(f), the model's own softmax over the two labels: the
    summary says so beside its flag count, and only there."""
    pols = tmp_path / "policies"
    shutil.copytree(SAMPLE / "policies", pols)
    meta = json.loads((pols / "pii" / "policy.json").read_text())
    del meta["calibration"]
    (pols / "pii" / "policy.json").write_text(json.dumps(meta))
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"id": "a", "text": "user: hi"}) + "\n")
    out = run("score", src, "-o", tmp_path / "o.parquet", "--policies", pols, "--no-progress").output
    lines = {ln.split(":")[0].strip(): ln for ln in out.splitlines() if "above threshold" in ln}
    assert "(uncalibrated: policy.json holds no calibration, so p = sigmoid(f))" in lines["pii"]
    assert "uncalibrated" not in lines["investment_advice"]
