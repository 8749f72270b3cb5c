"""Writing outputs loses no data: no command writes over its inputs, the model or a policy; an output and its
errors file change together or not at all; a killed run's temporary files are cleaned by the next one."""
from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE
from click.testing import CliRunner

from policyscan.cli.main import cli


def _log(path: Path, texts: list[str | None]) -> Path:
    path.write_text("".join(json.dumps({"id": f"r{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def _score(*args) -> object:
    return CliRunner().invoke(cli, ["score", *map(str, args), "--no-progress", "--max-length", "256"])


def _digest(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def test_quantize_into_its_own_model_dir_is_refused(tmp_path):
    model = shutil.copytree(SAMPLE / "model", tmp_path / "m")
    before = _digest(model)
    for out in (model, model / "fp8", tmp_path / "link"):
        if out.name == "link":
            out.symlink_to(model)
        res = CliRunner().invoke(cli, ["quantize", str(model), str(out)])
        assert res.exit_code == 2 and "MODEL_DIR" in res.output, res.output
    assert _digest(model) == before and not (model / "fp8").exists()


def test_an_output_errors_or_metadata_path_that_is_an_input_model_or_policy_file_is_refused(tmp_path):
    logs = _log(tmp_path / "logs.jsonl", ["hello", "my ssn is 123-45-6789"])
    model = shutil.copytree(SAMPLE / "model", tmp_path / "m")
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    os.link(logs, tmp_path / "alias.jsonl")
    kept = logs.read_bytes(), _digest(model), _digest(pol)
    common = ["--model", model, "--policies", pol]
    for args in ([logs, "-o", logs],  # the input itself, by the suffix's format
                 [logs, "-o", tmp_path / "alias.jsonl"],  # the same file through a hard link
                 [logs, "-o", tmp_path / "o.parquet", "--errors", logs],
                 [logs, "-o", tmp_path / "o.parquet", "--errors", pol / "policy.json"],
                 [logs, "-o", tmp_path / "o.parquet", "--errors", model / "tokenizer.json"],
                 [logs, "-o", tmp_path / "o.parquet", "--errors", tmp_path / "o.parquet"],
                 [logs, "-o", tmp_path / "x.jsonl", "--errors", tmp_path / "x.jsonl.meta.json"]):
        res = _score(*args, *common)
        assert res.exit_code == 2 and "choose another path" in res.output or "different paths" in res.output, \
            (args, res.output)
    assert (logs.read_bytes(), _digest(model), _digest(pol)) == kept
    assert not (tmp_path / "o.parquet").exists()


def test_files_policyscan_did_not_write_are_never_replaced_or_removed(tmp_path):
    logs = _log(tmp_path / "logs.jsonl", ["hello there"])
    notes = tmp_path / "notes.jsonl"
    notes.write_text('{"my": "notes"}\n')
    res = _score(logs, "-o", tmp_path / "o.parquet", "--errors", notes)  # a clean run used to delete it
    assert res.exit_code == 2 and "not a policyscan errors file" in res.output
    other = tmp_path / "other.parquet"
    pq.write_table(pa.table({"x": [1]}), other)
    res = _score(logs, "-o", other)
    assert res.exit_code == 2 and "not a policyscan output" in res.output
    assert notes.read_text() == '{"my": "notes"}\n' and pq.read_table(other).column_names == ["x"]


def test_a_clean_run_removes_the_stale_errors_file_of_its_output(tmp_path):
    logs = _log(tmp_path / "logs.jsonl", ["hello", ""])
    out, errs = tmp_path / "o.parquet", tmp_path / "o.parquet.errors.jsonl"
    assert _score(logs, "-o", out).exit_code == 3 and errs.is_file()
    _log(logs, ["hello", "fixed"])
    res = _score(logs, "-o", out)
    assert res.exit_code == 0, res.output
    assert not errs.exists() and pq.read_table(out).num_rows == 2


def _previous_run(tmp_path: Path) -> tuple[Path, Path, Path, dict]:
    logs = _log(tmp_path / "logs.jsonl", ["hello", ""])
    out = tmp_path / "o.parquet"
    assert _score(logs, "-o", out).exit_code == 3
    _log(logs, ["hello again", "", "and a third"])
    return logs, out, tmp_path / "o.parquet.errors.jsonl", _digest(tmp_path)


def test_a_full_disk_changes_neither_output_nor_errors_file(tmp_path, monkeypatch):
    """ENOSPC while the output is finished: one line, exit 1, the earlier output and errors file as they were."""
    from policyscan.engine.outputs import sinks

    logs, out, errs, before = _previous_run(tmp_path)

    def full(self, meta):
        raise OSError(errno.ENOSPC, "No space left on device", str(self.tmp))

    monkeypatch.setattr(sinks.ScoreWriter, "finish", full)
    res = _score(logs, "-o", out)
    assert res.exit_code == 1 and isinstance(res.exception, SystemExit)
    assert "No space left on device" in res.output and "disk is full" in res.output
    assert "Traceback" not in res.output and len(res.output.strip().splitlines()) == 2  # banner + error
    assert _digest(tmp_path) == before and not list(tmp_path.glob(".*"))


def test_a_full_disk_while_writing_jsonl_leaves_no_temporary_file(tmp_path, monkeypatch):
    """ENOSPC in a write, and again when the buffered file is closed on the way out (its flush): the temporary
    output and errors file still go, as the message says."""
    import builtins
    import io

    logs, _, _, before = _previous_run(tmp_path)
    real_open = builtins.open

    class Full(io.StringIO):
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self):
            raise OSError(errno.ENOSPC, "No space left on device")

    def open_(path, mode="r", *args, **kwargs):
        if "w" not in mode or ".tmp-" not in str(path):
            return real_open(path, mode, *args, **kwargs)
        real_open(path, mode, *args, **kwargs).close()  # the temporary file is there, as on a real disk
        return Full()

    monkeypatch.setattr(builtins, "open", open_)
    res = _score(logs, "-o", tmp_path / "new.scores.jsonl")
    monkeypatch.undo()
    assert res.exit_code == 1 and "disk is full" in res.output and "no partial output was left behind" in res.output
    assert _digest(tmp_path) == before and not list(tmp_path.glob(".*")), sorted(p.name for p in tmp_path.iterdir())


def test_a_failed_rename_puts_both_files_back(tmp_path, monkeypatch):
    """The errors file is renamed into place first; when the output's rename then fails, it is put back."""
    from policyscan.engine.outputs import sinks

    logs, out, errs, before = _previous_run(tmp_path)
    real = os.replace

    def replace(src, dst):
        if Path(src).name.startswith(".o.parquet.tmp-"):
            raise OSError(errno.EIO, "Input/output error", str(dst))
        return real(src, dst)

    monkeypatch.setattr(sinks.os, "replace", replace)
    res = _score(logs, "-o", out)
    assert res.exit_code == 1 and "Input/output error" in res.output
    assert _digest(tmp_path) == before and not list(tmp_path.glob(".*"))


def test_leftovers_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    logs = _log(tmp_path / "logs.jsonl", ["hello"])
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "60"])
    try:
        names = {"dead_out": f".o.parquet.tmp-{dead.pid}", "dead_err": f".o.parquet.errors.jsonl.tmp-{dead.pid}",
                 "dead_bak": f".o.parquet.bak-{dead.pid}", "live": f".o.parquet.tmp-{live.pid}",
                 "not_ours": f".notes.txt.tmp-{dead.pid}"}
        for n in names.values():
            (tmp_path / n).write_text("x")
        assert _score(logs, "-o", tmp_path / "o.parquet").exit_code == 0
        left = {p.name for p in tmp_path.glob(".*")}
        assert left == {names["live"], names["not_ours"]}
    finally:
        live.kill()
        live.wait()


def test_sigkill_leftover_is_cleaned_by_the_next_run(tmp_path):
    """A real SIGKILL mid-run (JSONL output: its temporary file exists from the start)."""
    logs = tmp_path / "logs.jsonl"
    shutil.copy(SAMPLE / "conversations.jsonl", logs)
    out = tmp_path / "o.jsonl"
    proc = subprocess.Popen([sys.executable, "-m", "policyscan.cli.main", "score", str(logs), "-o", str(out),
                             "--no-progress"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 120
    while not list(tmp_path.glob(".o.jsonl.tmp-*")) and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    if proc.returncode != -signal.SIGKILL or not list(tmp_path.glob(".o.jsonl.tmp-*")):
        pytest.skip("the run ended before it could be killed")
    _log(logs, ["hello"])
    assert _score(logs, "-o", out).exit_code == 0
    assert not list(tmp_path.glob(".*")) and out.is_file()
