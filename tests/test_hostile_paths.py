"""Paths that are not regular files, and files that change while they are read. Devices, FIFOs, sockets, dangling
links and link loops as outputs or named inputs are usage errors before anything is opened; found in a folder,
they are listed in the errors file with what they are, and the rest is scored. A file that changes while it is
read is listed too, and no hash is recorded for it, on one process and with workers. The command line runs as
a subprocess with a time limit: a regression that blocks or reads endlessly fails instead of hanging."""
from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE

from policyscan.engine import files
from policyscan.engine.errors import InputError
from policyscan.engine.inputs.discover import expand_inputs
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.outputs import sinks
from policyscan.engine.outputs.accounting import OutputSpec, StrictStop
from policyscan.engine.outputs.run_output import run_key, up_to_date
from policyscan.engine.parallel.workers import WorkerConfig, WorkerPool
from policyscan.engine.parallel.workers_run import score_inputs_workers
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run import pipeline
from policyscan.engine.run.pipeline import score_inputs
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

LINES = (SAMPLE / "conversations.jsonl").read_text().splitlines(keepends=True)
SETTINGS = EngineSettings("cpu", batch_tokens=4096, max_length=256, threads=1)


MEMORY_LIMIT = 8 << 30  # address space of a command: an endless read fails in seconds, not the machine


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def policyscan(*args, timeout: int = 60) -> tuple[int, str]:
    """The command line as a user runs it, in bounded time and memory: exit status, stdout and stderr together."""
    res = subprocess.run([sys.executable, "-m", "policyscan.cli.main", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout, preexec_fn=_limit_memory)
    return res.returncode, res.stdout + res.stderr


@pytest.fixture
def logs(tmp_path) -> Path:
    path = tmp_path / "logs.jsonl"
    path.write_text("".join(LINES[:3]))
    return path


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _link(path: Path, to: str | Path) -> Path:
    os.symlink(to, path)
    return path


def _socket(path: Path) -> Path:
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()  # the socket file stays
    return path


# (option, how the path is made in tmp_path, what the message calls it)
WRITES = [
    ("--errors", lambda d: Path("/dev/full"), "errors file /dev/full is a character device, not a regular file"),
    ("--errors", lambda d: Path("/dev/zero"), "errors file /dev/zero is a character device, not a regular file"),
    ("--errors", lambda d: _fifo(d / "e.jsonl"), "e.jsonl is a FIFO, not a regular file"),
    ("--errors", lambda d: _link(d / "e.jsonl", d / "nowhere"), "e.jsonl is a dangling symbolic link"),
    ("-o", lambda d: _link(d / "o.parquet", "/dev/zero"), "a character device, not a regular file (through a"),
    ("-o", lambda d: _fifo(d / "o.parquet"), "o.parquet is a FIFO, not a regular file"),
    ("-o", lambda d: _link(d / "o.parquet", d / "o.parquet"), "o.parquet is a symbolic link loop"),
    ("-o", lambda d: _fifo(d / "o.jsonl.meta.json").with_name("o.jsonl"), "o.jsonl.meta.json is a FIFO, not a"),
]


@pytest.mark.parametrize("option,make,said", WRITES, ids=[f"{o} {s}" for o, _, s in WRITES])
def test_an_output_that_is_not_a_regular_file_is_a_usage_error_before_anything_is_opened(tmp_path, logs, option,
                                                                                         make, said):
    target = make(tmp_path)
    args = ["-o", tmp_path / "o.parquet"] if option == "--errors" else []
    code, out = policyscan("score", logs, option, target, *args, "--no-progress")
    assert code == 2 and said in out and str(target) in out, out
    assert "Traceback" not in out and not (tmp_path / "o.parquet.errors.jsonl").exists()


def test_minus_o_dev_full_is_a_usage_error(logs):
    code, out = policyscan("score", logs, "-o", "/dev/full", "--no-progress")
    assert code == 2 and "-o /dev/full" in out, out


def test_the_errors_file_check_reads_bounded_lines(tmp_path, monkeypatch):
    """One endless line, or JSON nested past the parser's depth, is no errors file: never read whole, never a
    traceback."""
    monkeypatch.setattr(sinks, "LINE_LIMIT", 1024)
    long = tmp_path / "long.jsonl"
    long.write_bytes(b"x" * 5000)
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "\n")
    real = tmp_path / "real.jsonl"
    real.write_text(json.dumps({"file": "a", "row": 1, "line": None, "id": "x", "reason": "why"}) + "\n")
    assert not sinks.is_errors_file(long) and not sinks.is_errors_file(deep)
    assert sinks.is_errors_file(real)
    assert not sinks.is_errors_file(_fifo(tmp_path / "f.jsonl"))


NAMED = [
    (lambda d: _fifo(d / "in.jsonl"), "a FIFO, not a regular file"),
    (lambda d: Path("/dev/zero"), "a character device, not a regular file"),
    (lambda d: _link(d / "in.parquet", "/dev/zero"), "a character device, not a regular file (through a symbolic"),
    (lambda d: _socket(d / "s.jsonl"), "a socket, not a regular file"),
    (lambda d: _link(d / "in.jsonl", d / "gone.jsonl"), "a dangling symbolic link (to "),
    (lambda d: _link(d / "in.jsonl", d / "in.jsonl"), "a symbolic link loop"),
]


@pytest.mark.parametrize("make,said", NAMED, ids=[s for _, s in NAMED])
def test_a_named_input_that_is_not_a_regular_file_is_a_usage_error(tmp_path, make, said):
    path = make(tmp_path)
    code, out = policyscan("score", path, "-o", tmp_path / "o.parquet", "--no-progress")
    assert code == 2 and f"{path}: {said}" in out and "name a regular file, a directory or a glob" in out, out
    assert not (tmp_path / "o.parquet").exists()


def _hostile_folder(root: Path) -> tuple[Path, Path, dict[str, str]]:
    """A folder with one good log beside every kind of path that is not a regular file: the good file, and each
    other name with what its errors-file reason says."""
    d = root / "arch"
    d.mkdir()
    good = d / "good.jsonl"
    good.write_text("".join(LINES[:3]))
    _link(d / "dangling.jsonl", d / "rotated-away.jsonl")
    _link(d / "loop_a.jsonl", d / "loop_b.jsonl")
    _link(d / "loop_b.jsonl", d / "loop_a.jsonl")
    _fifo(d / "pipe.jsonl")
    _fifo(d / "pipe2.parquet")  # Arrow would wait on it for a writer
    _link(d / "zero.parquet", "/dev/zero")
    _socket(d / "sock.jsonl")
    bad = {"dangling.jsonl": "a dangling symbolic link (to ", "loop_a.jsonl": "a symbolic link loop",
           "loop_b.jsonl": "a symbolic link loop", "pipe.jsonl": "a FIFO, not a regular file",
           "pipe2.parquet": "a FIFO, not a regular file", "zero.parquet": "a character device, not a regular file",
           "sock.jsonl": "a socket, not a regular file"}
    return d, good, bad


def test_a_folder_gives_every_entry_that_is_not_a_regular_file_to_its_reader(tmp_path):
    d, good, bad = _hostile_folder(tmp_path)
    assert sorted(p.name for p in expand_inputs([str(d)])) == sorted([good.name, *bad])
    assert sorted(p.name for p in expand_inputs([str(d / "*.jsonl")])) == sorted(
        n for n in [good.name, *bad] if n.endswith(".jsonl"))
    for name, said in bad.items():
        with pytest.raises(InputError, match=re.escape(f"{name}: {said}")):
            list(read_chunks(d / name, ReadSpec(), str))
    other = tmp_path / "other"  # one FIFO reached by two names is one input
    other.mkdir()
    _link(other / "same.jsonl", d / "pipe.jsonl")
    notes: list[str] = []
    assert len(expand_inputs([str(d), str(other)], notes.append)) == 1 + len(bad)
    assert notes == [f"policyscan: {other / 'same.jsonl'} is the same file as {d / 'pipe.jsonl'}; it is read once"]


@pytest.mark.parametrize("workers", [(), ("--device", "cpu", "--workers", "2", "--threads", "1")],
                         ids=["one process", "two workers"])
def test_a_folder_with_broken_entries_scores_the_good_file_and_lists_the_others(tmp_path, workers):
    d, good, bad = _hostile_folder(tmp_path)
    out = tmp_path / "o.parquet"
    code, text = policyscan("score", d, "-o", out, "--no-progress", *workers, timeout=120)
    assert code == 3 and f"files that could not be read (see the errors file): {len(bad)}" in text, text
    assert pq.read_table(out).num_rows == 3
    errors = [json.loads(x) for x in (tmp_path / "o.parquet.errors.jsonl").read_text().splitlines()]
    assert sorted(Path(e["file"]).name for e in errors) == sorted(bad)
    for e in errors:
        assert e["row"] is None and e["reason"].startswith(f"{e['file']}: {bad[Path(e['file']).name]}"), e
    meta = json.loads(pq.ParquetFile(out).metadata.metadata[b"policyscan"])
    shas = {Path(r["path"]).name: r["sha256"] for r in meta["inputs"]}
    assert shas.pop(good.name) == hashlib.sha256(good.read_bytes()).hexdigest()
    assert set(shas) == set(bad) and not any(shas.values())  # no hash names bytes that were never read


def test_a_fifo_swapped_in_after_the_check_is_refused_on_its_descriptor(tmp_path, monkeypatch):
    """The descriptor is opened without waiting for a writer and looked at before anything is read."""
    monkeypatch.setattr(files, "check_regular", lambda path: None)
    fifo = _fifo(tmp_path / "x.jsonl")
    got: list[BaseException] = []
    t = threading.Thread(target=lambda: got.append(pytest.raises(InputError, files.open_regular, fifo).value),
                         daemon=True)
    t.start()
    t.join(30)
    assert not t.is_alive() and "a FIFO, not a regular file" in str(got[0])


@pytest.fixture(scope="module")
def engine():
    return Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"]), SETTINGS)


def _meta(out: Path) -> dict:
    return json.loads(pq.ParquetFile(out).metadata.metadata[b"policyscan"])


def _appended_after_hash(tmp_path: Path) -> tuple[Path, str]:
    """A log hashed as the `-o DIR/` path hashes it before scoring, then appended to before it is read."""
    src = tmp_path / "growing.jsonl"
    src.write_text("".join(LINES[:4]))
    sha = files.file_sha256(src)
    with open(src, "a") as f:
        f.write("".join(LINES[4:6]))
    return src, sha


def _changed_run_checks(src: Path, out: Path, errors: Path, acc, before: int) -> None:
    assert pq.read_table(out).num_rows == 6 and acc.files_in_errors == 1 and acc.balanced
    [e] = [json.loads(x) for x in errors.read_text().splitlines()]
    assert e["file"] == str(src) and e["row"] is None
    assert f"changed while it was read (its size went from {before} to {src.stat().st_size} bytes)" in e["reason"]
    assert "score it again when it is complete" in e["reason"]
    meta = _meta(out)
    assert meta["inputs"][0]["sha256"] is None and meta["inputs"][0]["changed_while_read"]
    assert meta["run_key"] is None  # `-o DIR/` never takes this output for up to date


def test_a_file_appended_to_after_its_hash_is_listed_and_not_hashed_as_what_was_read(engine, tmp_path):
    src, sha = _appended_after_hash(tmp_path)
    before = len("".join(LINES[:4]).encode())
    out, errors, spec, o = tmp_path / "o.parquet", tmp_path / "e.jsonl", ReadSpec(), OutputSpec()
    acc = score_inputs(engine, [src], out, errors, spec, o, keyed=True, input_sha256=[sha])
    _changed_run_checks(src, out, errors, acc, before)
    assert not up_to_date(out, run_key(engine, spec, o, files.file_sha256(src)))
    acc = score_inputs(engine, [src], out, errors, spec, o, keyed=True)  # the next night: complete, unchanged
    assert acc.files_in_errors == 0 and not errors.exists() and pq.read_table(out).num_rows == 6
    assert _meta(out)["inputs"][0]["sha256"] == hashlib.sha256(src.read_bytes()).hexdigest()  # the bytes scored
    assert up_to_date(out, run_key(engine, spec, o, files.file_sha256(src)))


def test_a_file_appended_to_while_it_is_read_is_listed(engine, tmp_path, monkeypatch):
    """The run hashes its inputs itself, then the file grows as its reader starts."""
    src = tmp_path / "growing.jsonl"
    src.write_text("".join(LINES[:4]))
    before = src.stat().st_size
    real = pipeline.read_chunks

    def grow_then_read(path, spec, render):
        with open(path, "a") as f:
            f.write("".join(LINES[4:6]))
        return real(path, spec, render)

    monkeypatch.setattr(pipeline, "read_chunks", grow_then_read)
    out, errors = tmp_path / "o.parquet", tmp_path / "e.jsonl"
    acc = score_inputs(engine, [src], out, errors, ReadSpec(), OutputSpec())
    _changed_run_checks(src, out, errors, acc, before)


def test_strict_stops_at_a_file_that_changed_while_it_was_read(engine, tmp_path):
    src, sha = _appended_after_hash(tmp_path)
    out = tmp_path / "o.parquet"
    with pytest.raises(StrictStop, match="changed while it was read"):
        score_inputs(engine, [src], out, tmp_path / "e.jsonl", ReadSpec(), OutputSpec(strict=True),
                     input_sha256=[sha])
    assert not out.exists() and not list(tmp_path.glob(".*tmp*"))


def test_workers_list_a_file_appended_to_after_its_hash(tmp_path):
    src, sha = _appended_after_hash(tmp_path)
    before = len("".join(LINES[:4]).encode())
    out, errors = tmp_path / "o.parquet", tmp_path / "e.jsonl"
    with WorkerPool(WorkerConfig(SAMPLE / "model", (SAMPLE / "policies",), SETTINGS, ("cpu",))) as pool:
        pool.expect(load_policies([SAMPLE / "policies"]))
        acc = score_inputs_workers(pool, [src], out, errors, ReadSpec(), OutputSpec(), keyed=True,
                                   input_sha256=[sha], unit_bytes=200)  # line ranges: several units
    _changed_run_checks(src, out, errors, acc, before)
