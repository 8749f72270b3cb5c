"""Worker processes (engine/parallel/workers*.py) on the CPU: two workers write bitwise what one worker and the
single-process path write, Parquet slices and JSONL line ranges alike; a killed worker loses no row; SIGTERM stops
every worker and leaves nothing."""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from faults import kill_workers_taking

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.inputs.units import LineRange, RowSlice, plan_units, range_lines, unit_chunks
from policyscan.engine.outputs.accounting import OutputSpec
from policyscan.engine.parallel.workers import WorkerConfig, WorkerPool, parse_devices
from policyscan.engine.parallel.workers_run import score_inputs_workers
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run.pipeline import score_inputs
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
SETTINGS = EngineSettings("cpu", batch_tokens=4096, max_length=256, threads=1)  # 1 thread: workers share 2 cores
UNIT_ROWS = 4  # slices inside row groups, several units per file
UNIT_BYTES = 1000  # JSONL ranges of two or three lines


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[Path]:
    """42 rows: Parquet with ids and bad rows (3 groups), JSONL with a malformed line, a line that is not UTF-8 and
    blank lines, Parquet without ids."""
    d = tmp_path_factory.mktemp("in")
    rows = pq.read_table(SAMPLE / "conversations.parquet").slice(0, 34).to_pylist()
    rows[3]["messages"], rows[10]["messages"] = None, []
    pq.write_table(pa.Table.from_pylist(rows[:24]), d / "a.parquet", row_group_size=8)
    lines = [line.encode() for line in (SAMPLE / "conversations.jsonl").read_text().splitlines()[24:32]]
    lines[2] = b"{not json"
    lines[5] = lines[5].replace(b"assistant", b"assist\xffant", 1)
    lines[4:4] = [b"", " \t\u3000".encode()]  # blank lines are no rows, but count as lines
    (d / "b.jsonl").write_bytes(b"\n".join(lines) + b"\n\n")
    pq.write_table(pa.Table.from_pylist([{"messages": r["messages"]} for r in rows[24:34]]), d / "c.parquet",
                   row_group_size=7)
    return [d / "a.parquet", d / "b.jsonl", d / "c.parquet"]


@pytest.fixture(scope="module")
def policies():
    return tuple(load_policies([SAMPLE / "policies"]))


@pytest.fixture(scope="module")
def reference(inputs, policies, tmp_path_factory):
    """The single-process path's output, errors file and accounting."""
    d = tmp_path_factory.mktemp("ref")
    acc = score_inputs(Engine(SAMPLE / "model", list(policies), SETTINGS), inputs, d / "o.parquet", d / "e.jsonl",
                       ReadSpec(), OutputSpec(raw=True))
    return pq.read_table(d / "o.parquet"), (d / "e.jsonl").read_text().splitlines(), acc


def _counts(acc) -> tuple:
    return (acc.rows_in, acc.rows_scored, acc.rows_in_errors, acc.files_in_errors, acc.prompt_tokens,
            acc.truncated_prompts, acc.duplicate_ids, acc.above_threshold)


def _run(pool, inputs, d: Path):
    acc = score_inputs_workers(pool, inputs, d / "o.parquet", d / "e.jsonl", ReadSpec(), OutputSpec(raw=True),
                               unit_rows=UNIT_ROWS, unit_bytes=UNIT_BYTES)
    errors = (d / "e.jsonl").read_text().splitlines() if (d / "e.jsonl").exists() else []
    return pq.read_table(d / "o.parquet"), errors, acc


def test_units_cover_every_row_once_in_order(inputs):
    units = plan_units(inputs, ReadSpec(), UNIT_ROWS, UNIT_BYTES)
    assert [u.index for u in units] == list(range(len(units)))
    by_file = {p: [r for u in units if u.path == p for r in u.part.file_rows] for p in inputs}
    assert by_file == {inputs[0]: list(range(24)), inputs[1]: list(range(8)), inputs[2]: list(range(10))}
    ranges = [u.part for u in units if u.path == inputs[1]]
    assert len(ranges) > 2 and all(isinstance(r, LineRange) for r in ranges)
    assert all(isinstance(u.part, RowSlice) for u in units if u.path != inputs[1])
    assert [u.part for u in plan_units([inputs[1]], ReadSpec())] == [None]  # a file smaller than a unit: whole


def _rows(chunks) -> list[tuple]:
    return [(c.first_row + i, c.ids[i].as_py(), c.lines[i], c.errors[i], c.texts[i]) for c in chunks
            for i in range(len(c))]


def test_jsonl_ranges_give_the_whole_file_readers_rows(tmp_path):
    """ids file:line, rows, lines, errors and texts as read_chunks gives them, whatever the ranges; blank lines
    (Unicode spaces too) are no rows, a line of U+200B is one, and a file may end without its newline."""
    lines = [b'{"text": "a"}', b"", b"  \t\r", " \u3000\xa0\x1c".encode(), "\u200b".encode(), b"{bad", b"\xff",
             b'  {"text": "b"}', "{\"text\": \"\u00fc\"}".encode(), b'{"text": 3}', b"[1]", b'{"text": "\xfe"}']
    spec = ReadSpec(chunk_rows=3)
    for n, end in enumerate((b"", b"\n", b"\n\n \n")):
        path = tmp_path / f"{n}.jsonl"
        path.write_bytes(b"\n".join(lines * 5) + end)
        whole = _rows(read_chunks(path, spec, str))
        for unit_bytes in (1, 40, 100, 10**6):
            units = plan_units([path], spec, unit_bytes=unit_bytes)
            assert [r for u in units for r in _rows(unit_chunks(u, spec, str))] == whole, unit_bytes
            for u in units:
                if u.part is not None:
                    assert range_lines(path, u.part) == [r[2] for r in _rows(unit_chunks(u, spec, str))]
    late = tmp_path / "late.jsonl"  # no object in the first chunk: the column is picked later, the file goes whole
    late.write_bytes(b"{x\n" * 3 + b'{"text": "a"}\n' * 50)
    assert [u.part for u in plan_units([late], spec, unit_bytes=40)] == [None]


def test_devices_are_all_a_count_or_indices():
    assert parse_devices("all", 4) == ("0", "1", "2", "3") and parse_devices("2", 4) == ("0", "1")
    assert parse_devices("0,2", 4) == ("0", "2")
    for bad in ("5", "0,0", "0,4", "x", ""):
        with pytest.raises(PolicyscanError, match="--devices"):
            parse_devices(bad, 4)
    with pytest.raises(PolicyscanError, match="cuda:1 names one device"):
        WorkerConfig(SAMPLE / "model", (), EngineSettings("cuda:1"), ("0", "1"))


def test_the_fork_server_starts_early_only_for_runs_with_workers(monkeypatch, tmp_path):
    from policyscan.engine.parallel import worker_start

    monkeypatch.setattr(worker_start, "NVIDIA_GPUS", tmp_path)  # a driver is present
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    will = worker_start.will_run_workers
    assert will(["score", "x.parquet"]) and will(["score", "x", "--devices", "0,1"]) and will(["score", "--workers=3"])
    assert not will(["score", "x", "--device", "cpu"]) and not will(["score", "x", "--device", "cuda:1"])
    assert will(["score", "x", "--workers", "1"])  # one worker a GPU, two GPUs
    assert not will(["score", "x", "--ray"]) and not will(["score", "--help"]) and not will(["calibrate", "score"])
    assert will(["score", "x", "--device", "cpu", "--workers", "2"])
    assert not will(["score", "x", "--device", "cpu", "--workers", "1"])
    assert not will(["score", "x", "--device=cpu"]) and will(["score", "x", "--device", "cpu", "--device=cuda"])
    assert will(["score", "x", "--device", "cpu", "--workers=1", "--workers", "4"])  # the last counts, as in click
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    assert not will(["score", "x.parquet"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    monkeypatch.setattr(worker_start, "NVIDIA_GPUS", tmp_path / "no_driver")
    assert not will(["score", "x.parquet"])  # CUDA_VISIBLE_DEVICES without a driver: a CPU machine


def test_a_worker_that_read_other_policies_than_this_process_stops_the_run(tmp_path):
    """Each worker reads the bundles itself while the parent does: an adapter changed in between (its weights, or
    the scales of its adapter_config.json) stops the run, whether the parent's policies come before the worker's
    or after."""
    shutil.copytree(SAMPLE / "policies", tmp_path / "policies")
    mine = load_policies([tmp_path / "policies"])
    changed = next(p for p in mine if p.adapter_sha256)
    weights = changed.path / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8] + b"\x00" * 8)  # the last factor's last elements
    config = WorkerConfig(SAMPLE / "model", (tmp_path / "policies",), SETTINGS, ("cpu",))
    with pytest.raises(PolicyscanError, match=f"policies changed while the run started \\({changed.path}"):
        with WorkerPool(config) as pool:
            pool.expect(mine)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                pool.events(1.0)
    mine = load_policies([tmp_path / "policies"])
    conf = changed.path / "adapter_config.json"
    conf.write_text(json.dumps({**json.loads(conf.read_text()), "lora_alpha": 1234}))
    with pytest.raises(PolicyscanError, match="policies changed while the run started"):
        with WorkerPool(config) as pool:
            while not pool.ready_workers():
                pool.events(1.0)
            pool.expect(mine)


def _pool(policies, devices: tuple[str, ...]) -> WorkerPool:
    """A pool of the sample's workers, expecting `policies` (the sample's, as the parent read them)."""
    pool = WorkerPool(WorkerConfig(SAMPLE / "model", (SAMPLE / "policies",), SETTINGS, devices))
    pool.expect(list(policies))  # raises only for a worker that is ready: none is yet
    return pool


def test_two_workers_write_the_bits_of_one_worker_and_of_the_single_process_path(inputs, policies, reference,
                                                                                 tmp_path):
    ref_table, ref_errors, ref_acc = reference
    assert ref_acc.rows_in_errors == 4 and ref_acc.rows_scored == 38  # the bad rows are there to be compared
    assert len([u for u in plan_units(inputs, ReadSpec(), UNIT_ROWS, UNIT_BYTES) if u.path == inputs[1]]) > 2
    for n in (1, 2):
        d = tmp_path / f"w{n}"
        d.mkdir()
        with _pool(policies, ("cpu",) * n) as pool:
            table, errors, acc = _run(pool, inputs, d)
        assert table.equals(ref_table), n
        assert errors == ref_errors
        assert _counts(acc) == _counts(ref_acc) and acc.balanced
        meta = json.loads(pq.ParquetFile(d / "o.parquet").metadata.metadata[b"policyscan"])
        assert meta["workers"] == ["cpu"] * n and meta["accounting"]["balanced"]


def test_a_killed_worker_loses_no_row_and_a_unit_that_kills_twice_is_listed(inputs, policies, reference, tmp_path,
                                                                            monkeypatch):
    ref_table, ref_errors, ref_acc = reference
    units = plan_units(inputs, ReadSpec(), UNIT_ROWS, UNIT_BYTES)
    poison = next(u for u in units if u.path == inputs[2] and u.part.group == 0 and u.part.first > 0)
    once = next(u for u in units if u.path == inputs[1] and u.part.first_row > 0)
    # SIGKILL (an OOM kill) of the worker taking a JSONL range, once; of every worker taking `poison`
    kill_workers_taking(monkeypatch, lambda i, attempt: i == poison.index or (i, attempt) == (once.index, 0))
    with _pool(policies, ("cpu", "cpu")) as pool:
        table, errors, acc = _run(pool, inputs, tmp_path)
        assert len(pool.deaths) == 3, pool.deaths
    lost_ids = [f"c.parquet:{r}" for r in poison.part.file_rows]
    assert table.equals(ref_table.filter(pc.invert(pc.is_in(ref_table["id"], pa.array(lost_ids)))))
    died = [json.loads(e) for e in errors if "died on these rows twice" in e]
    assert [e["row"] for e in died] == list(poison.part.file_rows) and "SIGKILL" in died[0]["reason"]
    assert [e for e in errors if "died on these rows twice" not in e] == ref_errors
    assert acc.balanced and acc.rows_in == ref_acc.rows_in
    assert acc.rows_in_errors == ref_acc.rows_in_errors + poison.part.rows  # the run's exit status is 3


def test_a_worker_that_reads_changed_policies_on_its_restart_is_given_up_and_the_run_goes_on(inputs, reference,
                                                                                              tmp_path, monkeypatch):
    """A worker restarted after a death reads the bundles again: changed since the run started, its slot is given
    up (as when it cannot load again) and the others score its units."""
    ref_table, ref_errors, ref_acc = reference
    shutil.copytree(SAMPLE / "policies", tmp_path / "policies")
    mine = load_policies([tmp_path / "policies"])
    units = plan_units(inputs, ReadSpec(), UNIT_ROWS, UNIT_BYTES)
    # SIGKILL of the worker taking unit 2, on its first try
    kill_workers_taking(monkeypatch, lambda i, attempt: (i, attempt) == (units[2].index, 0))
    with WorkerPool(WorkerConfig(SAMPLE / "model", (tmp_path / "policies",), SETTINGS, ("cpu", "cpu"))) as pool:
        pool.expect(mine)
        while len(pool.ready_workers()) < 2:
            pool.events(1.0)
        changed = next(p for p in mine if p.adapter_sha256)
        conf = changed.path / "adapter_config.json"
        conf.write_text(json.dumps({**json.loads(conf.read_text()), "lora_alpha": 1234}))
        table, errors, acc = _run(pool, inputs, tmp_path)
        assert any("read other policies than the run's when it started again" in d and str(changed.path) in d
                   for d in pool.deaths), pool.deaths
    assert table.equals(ref_table) and errors == ref_errors and _counts(acc) == _counts(ref_acc)


SCRIPT = """
import signal, sys
from pathlib import Path
from policyscan.engine.outputs.accounting import OutputSpec
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.settings import EngineSettings
from policyscan.engine.inputs.sources import ReadSpec
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.parallel.workers import WorkerConfig, WorkerPool, parse_devices
from policyscan.engine.parallel.workers_run import score_inputs_workers


def stop(signum, frame):
    raise KeyboardInterrupt  # as cli/main.py does


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, stop)
    sample, out = Path(sys.argv[1]), Path(sys.argv[2])
    settings = EngineSettings("cpu", batch_tokens=4096, max_length=256, threads=1)
    config = WorkerConfig(sample / "model", (sample / "policies",), settings, ("cpu", "cpu"))
    with WorkerPool(config) as pool:
        pool.expect(load_policies([sample / "policies"]))
        print(*pool.pids(), flush=True)
        try:
            score_inputs_workers(pool, [sample / "conversations.parquet"] * 4, out / "o.parquet", out / "e.jsonl",
                                 ReadSpec(), OutputSpec(), unit_rows=10)
        except KeyboardInterrupt:
            sys.exit(130)
"""


def test_sigterm_stops_every_worker_and_leaves_no_partial_output(tmp_path):
    (tmp_path / "run.py").write_text(SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    proc = subprocess.Popen([sys.executable, str(tmp_path / "run.py"), str(SAMPLE), str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    deadline = time.time() + 60
    while not list(out.glob(".o.parquet.tmp-*")) and time.time() < deadline:  # the first rows are written
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130 and len(pids) == 2, log
    assert os.listdir(out) == [], log
    assert not any(Path(f"/proc/{pid}").exists() for pid in pids), log


def test_cli_workers_write_the_single_process_table_and_refuse_workers_on_gpus(tmp_path):
    """`score --workers 2` on the CPU writes the table the in-process run writes; --workers is for the CPU."""
    from click.testing import CliRunner

    from policyscan.cli.main import cli

    sample = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
    src = tmp_path / "logs.parquet"
    pq.write_table(pq.read_table(sample / "conversations.parquet").slice(0, 30), src, row_group_size=7)
    args = ["score", str(src), "--raw", "--no-progress", "--device", "cpu"]
    res = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "one.parquet")])
    assert res.exit_code == 0, res.output
    # as a user runs it: the workers re-import the command line as their parent's main module (and must not start
    # a fork server of their own while they bootstrap)
    two = subprocess.run([sys.executable, "-m", "policyscan.cli.main", *args, "-o", str(tmp_path / "two.parquet"),
                          "--workers", "2"], capture_output=True, text=True, timeout=300)
    assert two.returncode == 0 and "[2 workers: cpu, cpu]" in two.stderr, two.stderr[-3000:]
    assert pq.read_table(tmp_path / "one.parquet").equals(pq.read_table(tmp_path / "two.parquet"))
    res = CliRunner().invoke(cli, ["score", str(src), "-o", str(tmp_path / "g.parquet"), "--device", "cuda",
                                   "--workers", "2", "--no-progress"])
    assert res.exit_code == 2 and "--workers is for the CPU" in res.output
    # the workers start before the policies are read: a bad bundle path ends them with the run
    import multiprocessing

    res = CliRunner().invoke(cli, [*args, "-o", str(tmp_path / "bad.parquet"), "--workers", "2", "--policies",
                                   str(tmp_path / "nowhere")])
    assert res.exit_code == 1 and "nowhere: no such policy bundle or folder" in res.output, res.output
    assert not multiprocessing.active_children() and not (tmp_path / "bad.parquet").exists()
