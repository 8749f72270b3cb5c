"""policyscan report as a user runs it: the page's figures are the output's, every layout and batch size gives the
same figures, the review queue goes back into calibrate and evaluate, and what is not an output (or does not
belong with the others) is refused with what it is."""
from __future__ import annotations

import json
import re
import shutil
from html import unescape

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE, run
from click.testing import CliRunner
from report_cases import number, page_figures, score, timed_input

from policyscan.cli.main import cli
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.report.aggregate import Selection, summarize
from policyscan.report.outputs import open_output
from policyscan.report.review import queue_rows


@pytest.fixture(scope="module")
def outs(tmp_path_factory, sample_slice):
    """The sample slice with a time column scored wide to Parquet (--raw) and long to JSONL, and a JSONL input with
    two bad lines scored with an errors file."""
    root = tmp_path_factory.mktemp("report")
    inp = timed_input(root, sample_slice["parquet"])
    wide = score(inp, root / "wide.scores.parquet", "--raw", "--keep", "ts")
    long = score(inp, root / "long.scores.jsonl", "--layout", "long", "--keep", "ts")
    bad = root / "bad.jsonl"
    lines = sample_slice["jsonl"].read_text().splitlines()[:10]
    bad.write_text("\n".join(lines[:4] + ["{not json", '{"id": "e1", "messages": null}'] + lines[4:]) + "\n")
    errs = score(bad, root / "bad.scores.parquet")
    return {"root": root, "input": inp, "wide": wide, "long": long, "bad": errs, "bad_input": bad}


def _report(*args, ok=(0,)):
    return CliRunner().invoke(cli, ["report", *map(str, args)]) if ok != (0,) else run("report", *args)


def test_the_page_shows_the_outputs_figures(outs, tmp_path):
    page = tmp_path / "r.html"
    res = _report(outs["wide"], "-o", page, "--top", 5)
    html = page.read_text()
    fig = page_figures(html)
    t = pq.read_table(outs["wide"])
    meta = open_output(outs["wide"]).meta
    flags = {}
    for pol in meta["policies"]:
        name, thr = pol["name"], pol["threshold"]
        p = np.array(t.column(f"p_{name}").to_pylist())
        flags[name] = p >= thr
        assert number(fig[("flagged", name)]) == flags[name].sum() == meta["accounting"]["above_threshold"][name]
        assert number(fig[("flag_rate", name)]) == pytest.approx(flags[name].mean(), abs=5e-5)
        assert number(fig[("mean_p", name)]) == pytest.approx(p.mean(), abs=5e-5)
        assert f"{name}: {flags[name].sum():,} of 40 flagged" in res.output
    both = int((flags["pii"] & flags["investment_advice"]).sum())
    assert number(fig[("coflag", "investment_advice", "pii")]) == both  # attributes sorted: other, policy
    assert number(fig[("rows_scored",)]) == 40 and number(fig[("rows_in_errors",)]) == 0
    assert html.count("<svg") == 2 and meta["model"]["sha256"] in html
    assert "Excerpts are not shown" in html
    # the top flagged rows are the highest p, in order
    top = [i.strip() for i in html.split('data-row-of="pii">')[1:6]]
    want = t.column("id").to_numpy(zero_copy_only=False)[np.argsort(-np.array(t.column("p_pii").to_pylist()),
                                                                    kind="stable")[:5]]
    assert [s.split("<")[0] for s in top] == list(want)


def test_layouts_and_batch_sizes_give_the_same_figures(outs):
    wide, long = open_output(outs["wide"]), open_output(outs["long"])
    sel = Selection(top=7, review=6, review_by="stratified")
    runs = [summarize([wide], "ts", sel), summarize([wide], "ts", sel, batch_rows=3),
            summarize([long], "ts", sel, batch_rows=5)]
    first = runs[0]
    for s in runs[1:]:
        assert s.rows == first.rows == 40
        assert (s.coflag == first.coflag).all() and (s.flag_counts == first.flag_counts).all()
        assert s.timeline.series() == first.timeline.series()
        for a, b in zip(s.policies, first.policies):
            assert (a.hist == b.hist).all() and a.flagged == b.flagged
            assert [r.id for r in a.top.rows] == [r.id for r in b.top.rows]
            assert [r.id for r in a.near.rows] == [r.id for r in b.near.rows]
            assert [r.id for _, r, _ in queue_rows(s, "stratified", 6)] == \
                [r.id for _, r, _ in queue_rows(first, "stratified", 6)]


def test_flags_over_time(outs, tmp_path):
    page = tmp_path / "t.html"
    _report(outs["wide"], "-o", page, "--time-column", "ts")
    html = page.read_text()
    fig = page_figures(html)
    # 40 conversations two hours apart from 22:00: more than three days, so by the day
    days = {k[2]: number(v) for k, v in fig.items() if k[0] == "flagged_at" and k[1] == "pii"}
    assert list(days) == ["2026-11-30", "2026-12-01", "2026-12-02", "2026-12-03", "2026-12-04"]
    assert sum(days.values()) == number(fig[("flagged", "pii")])
    assert "flag rate over time" in html and "By day of the column 'ts'" in unescape(html)
    res = _report(outs["wide"], "-o", page, "--time-column", "nope", ok=(2,))
    assert res.exit_code == 2 and "no column 'nope'" in res.output


def test_errors_by_reason_and_accounting(outs, tmp_path):
    page = tmp_path / "e.html"
    _report(outs["bad"], outs["wide"], "-o", page)
    html = page.read_text()
    fig = page_figures(html)
    errs = {k[1]: number(v) for k, v in fig.items() if k[0] == "errors"}
    assert sum(errs.values()) == 2 == number(fig[("rows_in_errors",)])
    assert any("malformed JSON" in k for k in errs) and any("null conversation" in k for k in errs)
    assert number(fig[("rows_scored",)]) == 40 + 10
    assert "rows in 52 = scored 50 + in errors 2 (balanced)" in html
    # each output's time is the one score recorded when it committed the output, not the file's
    written = read_metadata(outs["wide"])["written_at"]
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", written) and written in html
    assert "file time" not in html


def test_review_queue_is_labeled_data_for_calibrate_and_evaluate(outs, tmp_path):
    queue = tmp_path / "q.jsonl"
    res = _report(outs["wide"], "-o", tmp_path / "r.html", "--review", queue, "--review-rows", 12,
                  "--review-by", "stratified")
    rows = [json.loads(line) for line in queue.read_text().splitlines()]
    assert "24 rows to review" in res.output and len(rows) == 24
    assert set(rows[0]) == {"id", "policy", "p", "f", "threshold", "messages", "label", "selected", "output"}
    assert {r["policy"] for r in rows} == {"pii", "investment_advice"} and all(r["label"] is None for r in rows)
    src = {r["id"]: r["messages"] for r in pq.read_table(outs["input"]).to_pylist()}
    assert all(r["messages"] == src[r["id"]] for r in rows)
    for r in rows:  # a person labels them (here: the verdict itself), one left unlabeled
        r["label"] = "violation" if r["p"] >= r["threshold"] else "compliant"
    rows[0]["label"] = None
    queue.write_text("".join(json.dumps(r) + "\n" for r in rows))
    pii = [r for r in rows if r["policy"] == "pii" and r["label"] is not None]
    out = tmp_path / "e.json"
    res = run("evaluate", queue, "--policy", SAMPLE / "policies" / "pii", "--json", out, "--bootstrap", 10,
              "--max-length", "512")
    got = json.loads(out.read_text())["policies"]["pii"]
    assert got["rows"] == len(pii) and got["violations"] == sum(r["label"] == "violation" for r in pii)
    assert got["recall"] == 1.0 and got["label_column"] == "label"
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    res = run("calibrate", queue, "--policy", bundle, "--dry-run", "--force", "--holdout", "0", "--max-length", "512")
    assert f"fitted on {len(pii)} rows" in res.output


def test_excerpts_come_from_the_recorded_inputs(outs, tmp_path):
    page = tmp_path / "x.html"
    res = _report(outs["wide"], "-o", page, "--inputs", "--top", 3)
    html = page.read_text()
    assert "user: Hi, can you help me" in html and "Excerpts are not shown" not in html and not res.stderr_bytes
    moved = tmp_path / "moved.parquet"
    shutil.copy(outs["input"], moved)
    out = score(moved, tmp_path / "m.scores.parquet")
    t = pq.read_table(moved)
    pq.write_table(t.slice(1), moved)  # the input changed after it was scored
    res = CliRunner().invoke(cli, ["report", str(out), "-o", str(page), "--inputs"])
    assert res.exit_code == 0 and "changed since it was scored" in res.output
    assert "changed since it was scored" in page.read_text()


def test_what_is_not_an_output_is_refused_with_what_it_is(outs, tmp_path):
    cases = [(outs["input"], "a Parquet file of 40 rows with columns ['id', 'messages', 'ts'], without policyscan "
                             "metadata"),
             (outs["bad"].with_name(outs["bad"].name + ".errors.jsonl"), "a policyscan errors file"),
             (outs["bad_input"], "a JSONL file with no bad.jsonl.meta.json beside it"),
             (tmp_path / "none.parquet", "no such file or folder")]
    for path, msg in cases:
        res = CliRunner().invoke(cli, ["report", str(path), "-o", str(tmp_path / "r.html")])
        assert res.exit_code == 2 and msg in " ".join(res.output.split()), res.output
    res = CliRunner().invoke(cli, ["report", str(outs["wide"]), "-o", str(outs["input"])])
    assert res.exit_code == 2 and "would destroy it" in res.output


def test_outputs_of_other_policies_are_refused(outs, tmp_path, sample_slice):
    only = score(sample_slice["parquet"], tmp_path / "only.scores.parquet", "--policies", SAMPLE / "policies" / "pii")
    res = CliRunner().invoke(cli, ["report", str(outs["wide"]), str(only), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "with different policies (investment_advice, pii and pii)" in res.output
    bundle = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "p" / "pii")
    meta = json.loads((bundle / "policy.json").read_text())
    meta["calibration"]["a"] = 2.0
    (bundle / "policy.json").write_text(json.dumps(meta))
    other = score(sample_slice["parquet"], tmp_path / "other.scores.parquet", "--policies", bundle)
    res = CliRunner().invoke(cli, ["report", str(only), str(other), "-o", str(tmp_path / "r.html")])
    assert res.exit_code == 2 and "different versions of policy 'pii' (calibration a" in res.output
    # a folder: its *.scores.* files, which agree on the policies, but two of them hold the same input's rows
    folder = CliRunner().invoke(cli, ["report", str(outs["root"]), "-o", str(tmp_path / "r.html")])
    assert folder.exit_code == 2 and "both hold the rows of input" in folder.output, folder.output


def test_page_text_is_escaped(tmp_path):
    src = tmp_path / "x.jsonl"
    src.write_text("".join(json.dumps({"id": f"<script>alert({i})</script>", "text": f"hello <b>{i}</b> & bye"})
                           + "\n" for i in range(3)))
    out = score(src, tmp_path / "x.scores.jsonl")
    page = tmp_path / "x.html"
    _report(out, "-o", page, "--inputs")
    html = page.read_text()
    assert "<script" not in html and "&lt;script&gt;alert(0)&lt;/script&gt;" in html
    assert "hello &lt;b&gt;0&lt;/b&gt; &amp; bye" in html
    assert "Content-Security-Policy" in html and "http://" not in html.replace("http://www.w3.org/2000/svg", "")


def test_an_id_that_names_two_input_rows_gets_no_excerpt_or_review_entry(outs, tmp_path):
    """The review queue and the excerpts find a row's conversation by id: where the id names two rows (ids repeat,
    here the last rows reuse the first rows' ids), the conversation beside a score could be another row's, so those
    ids get none, and a note says why; the other ids keep theirs."""
    src = pq.read_table(outs["input"]).slice(0, 12).to_pylist()
    rows = src[:8] + [dict(r, id=src[i]["id"]) for i, r in enumerate(src[8:])]  # rows 8-11 reuse ids 0-3
    inp = tmp_path / "dup.jsonl"
    inp.write_text("".join(json.dumps({k: v for k, v in r.items() if k != "ts"}) + "\n" for r in rows))
    out = score(inp, tmp_path / "dup.scores.parquet")
    queue = tmp_path / "q.jsonl"
    res = _report(out, "-o", tmp_path / "r.html", "--inputs", "--review", queue, "--review-rows", 40)
    assert "4 of the listed ids name more than one input row" in " ".join(res.output.split())
    got = [json.loads(line) for line in queue.read_text().splitlines()]
    repeated = {r["id"] for r in src[:4]}
    assert got and not any(r["id"] in repeated for r in got)
    by_id = {r["id"]: r["messages"] for r in rows[4:8]}
    assert all(r["messages"] == by_id[r["id"]] for r in got)


def test_two_outputs_of_one_input_are_refused(outs, tmp_path):
    """A copied output (or one written flat and again in its folder) holds the same input's rows: reported together
    they would count twice."""
    folder = tmp_path / "scores"
    folder.mkdir()
    shutil.copy(outs["wide"], folder / "a.scores.parquet")
    shutil.copy(outs["wide"], folder / "b.scores.parquet")
    res = _report(folder, "-o", tmp_path / "r.html", ok=(2,))
    assert res.exit_code == 2 and "both hold the rows of input" in res.output and "would count twice" in res.output
    assert not (tmp_path / "r.html").exists()
