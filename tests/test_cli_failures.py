"""policyscan score when something goes wrong: bad usage, a wrong adapter, unreadable files and rows, --strict,
interrupts and SIGTERM, settings out of range."""
from __future__ import annotations

import json
import shutil
import sys

import pyarrow.parquet as pq
from cli_cases import SAMPLE, run
from click.testing import CliRunner

from policyscan.cli.main import cli


def test_strict_stops_and_leaves_nothing(tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "fine"}) + "\n" + json.dumps({"text": ""}) + "\n")
    out = tmp_path / "o.parquet"
    res = CliRunner().invoke(cli, ["score", str(src), "-o", str(out), "--strict", "--no-progress"])
    assert res.exit_code == 1 and "line 2: empty conversation" in res.output
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_unreadable_file_is_reported_and_the_run_goes_on(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "hello there"}) + "\n")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet at all")
    out = tmp_path / "o.parquet"
    res = run("score", good, bad, "-o", out, "--no-progress", ok=(3,))
    assert pq.read_table(out).num_rows == 1
    err = json.loads((tmp_path / "o.parquet.errors.jsonl").read_text())
    assert err["file"].endswith("bad.parquet") and "not a readable Parquet file" in err["reason"]
    assert "files that could not be read" in res.output


def test_interrupt_leaves_no_partial_file(tmp_path, monkeypatch):
    from policyscan.engine.run import runner

    def boom(self, convs):
        raise KeyboardInterrupt

    monkeypatch.setattr(runner.Engine, "score_conversations", boom)
    out = tmp_path / "o.parquet"
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.jsonl"), "-o", str(out), "--no-progress"])
    assert res.exit_code == 130 and not out.exists() and not list(tmp_path.glob(".*"))


def test_usage_errors_exit_2(tmp_path):
    """Usage errors exit 2 with one line (the README's exit status), before the model loads."""
    res = CliRunner().invoke(cli, ["score", str(tmp_path / "missing.parquet"), "--no-progress"])
    assert res.exit_code == 2 and "no such file or directory" in res.output
    res = CliRunner().invoke(cli, ["score", "x", "--format", "csv"])
    assert res.exit_code == 2
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--text-column", "a",
                                   "--messages-column", "b"])
    assert res.exit_code == 2 and "not both" in res.output
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--device", "tpu"])
    assert res.exit_code == 2 and "'tpu'" in res.output and "cuda:N" in res.output
    res = CliRunner().invoke(cli, ["verify", str(SAMPLE / "conversations.parquet"), "--device", "tpu"])
    assert res.exit_code == 2
    assert not res.exception or isinstance(res.exception, SystemExit)


def test_wrong_adapter_for_the_model(tmp_path):
    from hf_fixtures import SPECS, make_model, make_policy

    other = make_model(tmp_path / "other", "llama")
    make_policy(other, tmp_path / "foreign", "foreign", SPECS[0], seed=0)
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--policies",
                                   str(tmp_path / "foreign"), "--no-progress"])
    # labels are checked against the tokenizer first: '<3>' and '<7>' both start with '<' in the sample's
    assert res.exit_code == 1 and "labels '<3>'" in res.output and "start with the same token" in res.output


def test_a_text_the_tokenizer_drops_is_an_error_row(tmp_path):
    """Some tokenizers normalize a text to nothing; with no BOS or template that would be an empty prompt."""
    from policyscan.engine.inputs.sources import ReadSpec
    from policyscan.engine.outputs.accounting import OutputSpec
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.pipeline import score_inputs
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    engine = Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"]), EngineSettings("cpu", max_length=256))
    real = engine.encoder.encode_batch
    engine.encoder.encode_batch = lambda texts: [[] if "VANISH" in t else ids for t, ids in zip(texts, real(texts))]
    src = tmp_path / "in.jsonl"
    src.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in
                           enumerate(["hello there", "VANISH", "my card number is 4111"])))
    acc = score_inputs(engine, [src], tmp_path / "o.parquet", tmp_path / "e.jsonl", ReadSpec(), OutputSpec())
    assert acc.balanced and acc.rows_scored == 2 and acc.rows_in_errors == 1
    assert pq.read_table(tmp_path / "o.parquet").column("id").to_pylist() == ["0", "2"]
    err = json.loads((tmp_path / "e.jsonl").read_text())
    assert err["line"] == 2 and err["id"] == "1" and "encodes to no tokens" in err["reason"]


def test_sigterm_leaves_no_partial_file_and_a_rerun_resumes(tmp_path):
    """A cron job killed mid-run: no output or temporary file is left; the next run scores what is missing."""
    import os
    import signal
    import subprocess
    import time

    arch = tmp_path / "archive"
    arch.mkdir()
    pq.write_table(pq.read_table(SAMPLE / "conversations.parquet").slice(0, 10), arch / "day1.parquet")
    # day2 is scored right after day1's output appears: the signal comes while it runs (its 200 rows take
    # over a second on an idle machine; the poll below sees day1's output within 20 ms)
    shutil.copy(SAMPLE / "conversations.jsonl", arch / "day2.jsonl")
    out = tmp_path / "scores"
    cmd = [sys.executable, "-m", "policyscan.cli.main", "score", str(arch), "-o", f"{out}/", "--no-progress"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 120
    while not (out / "day1.scores.parquet").exists() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, log
    assert sorted(os.listdir(out)) == ["day1.scores.parquet"], log  # day2 left no partial or temporary file
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "day1.parquet: up to date" in res.stderr and "day2.scores.parquet" in res.stderr
    assert pq.read_table(out / "day2.scores.parquet").num_rows == 200


def test_engine_setting_errors_are_for_people():
    import torch

    if not torch.cuda.is_available():
        res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--device", "cuda"])
        assert res.exit_code == 1 and "no CUDA GPU is visible; use --device cpu" in res.output
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--max-length", "10"])
    assert res.exit_code == 1 and "raise --max-length" in res.output
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--batch-tokens", "100"])
    assert res.exit_code == 2 and "--batch-tokens (100) must be at least the 1024 tokens a prompt may take" in res.output
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.parquet"), "--batch-tokens", "100",
                                   "--max-length", "512"])
    assert res.exit_code == 2 and "--batch-tokens (100) must be at least --max-length (512)" in res.output
