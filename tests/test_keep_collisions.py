"""`score --keep` of a column named like one the output writes (the ids, p_/f_/flagged_<policy>, truncated, the long
layout's policy/p/f/flagged) is a usage error before anything is scored, on every path that writes scores; so are a
column kept twice and the id column kept again."""
from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE

from policyscan.engine.outputs.columns import check_keep, output_columns
from policyscan.engine.outputs.sinks import ScoreWriter, commit_together, read_metadata
from policyscan.engine.settings import OptionError

COLUMNS = ["id", "uid", "text", "p_pii", "f_pii", "flagged_pii", "truncated", "policy", "p", "f", "flagged", "note"]


def policyscan(*args, timeout=120) -> tuple[int, str, float]:
    """The command line as a user runs it: exit status, stdout and stderr together, seconds."""
    t = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "policyscan.cli.main", *map(str, args)], capture_output=True,
                         text=True, timeout=timeout)
    return res.returncode, res.stdout + res.stderr, time.perf_counter() - t


@pytest.fixture(scope="module")
def logs(tmp_path_factory):
    """Three conversations with an input column of every name an output column can have."""
    path = tmp_path_factory.mktemp("keep") / "logs.parquet"
    cols = {c: [f"{c}{i}" for i in range(3)] for c in COLUMNS}
    cols["text"] = ["user: hello there", "user: my ssn is 078-05-1120", "user: buy stocks now"]
    pq.write_table(pa.table(cols), path)
    return path


CLASHES = [
    (["--keep", "id", "--id-column", "uid"], "--keep id collides with the output column 'id'", "--id-column uid"),
    (["--keep", "id"], "--keep id: 'id' is the output column of the ids", "drop --keep id"),
    (["--keep", "uid", "--id-column", "uid"], "--keep uid: 'uid' is the id column (--id-column uid)",
     "drop --keep uid"),
    (["--keep", "p_pii"], "--keep p_pii collides with the output column 'p_pii'", "rename the input column"),
    (["--keep", "f_pii", "--raw"], "--keep f_pii collides with the output column 'f_pii' (--raw)", "drop --raw"),
    (["--keep", "flagged_pii", "--flagged"], "--keep flagged_pii collides with the output column 'flagged_pii'",
     "drop --flagged"),
    (["--keep", "truncated", "--mark-truncated"], "--keep truncated collides with the output column 'truncated'",
     "drop --mark-truncated"),
    (["--keep", "policy", "--layout", "long"], "--keep policy collides with the output column 'policy'",
     "drop --layout long"),
    (["--keep", "p", "--layout", "long"], "--keep p collides with the output column 'p'", "drop --keep p"),
    (["--keep", "f", "--layout", "long", "--raw"], "--keep f collides with the output column 'f' (--raw)",
     "drop --raw"),
    (["--keep", "flagged", "--layout", "long", "--flagged"], "--keep flagged collides with the output column",
     "drop --flagged"),
    (["--keep", "note", "--keep", "note"], "--keep note is given twice", "give each kept column once"),
    # a column policyscan writes under another option: kept, it would pass for policyscan's own (f_pii without --raw
    # for the scores --from-scores reads, policy and p in the wide layout for the long layout's)
    (["--keep", "f_pii"], "--keep f_pii: 'f_pii' is a column policyscan writes under another option", "drop --keep"),
    (["--keep", "p"], "--keep p: 'p' is a column policyscan writes under another option", "drop --keep p"),
    (["--keep", "policy"], "'policy' is a column policyscan writes under another option", "drop --keep policy"),
    (["--keep", "truncated"], "'truncated' is a column policyscan writes under another option", "drop --keep"),
    (["--keep", "p_pii", "--layout", "long"], "'p_pii' is a column policyscan writes under another option",
     "rename the input column"),
]


@pytest.mark.parametrize("args,clash,fix", CLASHES, ids=[" ".join(a) for a, _, _ in CLASHES])
def test_a_kept_column_that_collides_is_a_usage_error_before_the_model_loads(tmp_path, logs, args, clash, fix):
    out = tmp_path / "o.parquet"
    # an empty model folder: loading it would fail (exit 1), so exit 2 shows the check came first
    (tmp_path / "no-model").mkdir()
    rc, log, seconds = policyscan("score", logs, "-o", out, "--no-progress", "--model", tmp_path / "no-model", *args)
    assert rc == 2 and clash in log and fix in log, log
    assert "Traceback" not in log and not out.exists() and seconds < 30


def test_a_column_no_score_output_holds_is_kept_as_it_is(tmp_path, logs):
    out = tmp_path / "o.parquet"
    rc, log, _ = policyscan("score", logs, "-o", out, "--no-progress", "--id-column", "uid", "--keep", "note")
    assert rc == 0, log
    got = pq.read_table(out)
    assert got.column_names == ["id", "note", "p_investment_advice", "p_pii"]
    assert got.column("id").to_pylist() == ["uid0", "uid1", "uid2"]
    assert got.column("note").to_pylist() == ["note0", "note1", "note2"]


def test_ray_and_worker_runs_refuse_a_collision_before_scoring(tmp_path, logs):
    """score --ray refuses before it connects (no Ray started), --workers before any worker scores, and the
    worker processes end with the run."""
    out = tmp_path / "o.parquet"
    rc, log, seconds = policyscan("score", logs, "-o", out, "--no-progress", "--keep", "id", "--id-column", "uid",
                                  "--device", "cpu", "--ray")
    assert rc == 2 and "--keep id collides with the output column 'id'" in log and "Ray" not in log, log
    assert not out.exists() and seconds < 30
    rc, log, _ = policyscan("score", logs, "-o", out, "--no-progress", "--keep", "p_pii", "--device", "cpu",
                            "--workers", "2")
    assert rc == 2 and "--keep p_pii collides with the output column 'p_pii'" in log and "Traceback" not in log, log
    assert not out.exists() and not multiprocessing.active_children()


def test_output_columns_name_what_the_writer_writes(tmp_path):
    """output_columns is what ScoreWriter writes after the id and the kept columns, for every layout and flag."""
    names = ["pii", "advice"]
    p = np.array([[0.2, 0.9], [0.6, 0.1]])
    for layout in ("wide", "long"):
        for raw in (False, True):
            for flagged in (False, True):
                for truncation in (False, True):
                    w = ScoreWriter(tmp_path / "o.parquet", "parquet", layout, names, raw,
                                    [0.5, 0.5] if flagged else None, truncation)
                    w.write(pa.array(["a", "b"]), {"note": pa.array(["x", "y"])}, p, p)
                    commit_together(w.finish({}), [])
                    cols = output_columns(names, layout, raw, flagged, truncation)
                    assert pq.read_table(tmp_path / "o.parquet").column_names == ["id", "note", *cols]


def test_the_writer_refuses_a_colliding_kept_column_from_any_caller(tmp_path):
    """A library caller that skipped the check before scoring gets it at the first write, and nothing is written."""
    w = ScoreWriter(tmp_path / "o.jsonl", "jsonl", "wide", ["pii"], True)
    p = np.array([[0.5]])
    for kept in ("id", "p_pii", "f_pii"):
        with pytest.raises(OptionError, match=f"--keep {kept}"):
            w.write(pa.array(["a"]), {kept: pa.array(["x"])}, p, p)
    w.abort()
    assert list(tmp_path.iterdir()) == []


def test_check_keep_accepts_distinct_free_columns():
    check_keep(("note", "uid", "p"), "id", output_columns(["pii"], "wide", True, True, True))
    with pytest.raises(OptionError, match="--keep p collides"):
        check_keep(("note", "p"), None, output_columns(["pii"], "long", False, False, False))


def test_verify_refuses_an_output_whose_ids_a_kept_column_replaced(tmp_path, logs):
    """An output written before the check, its `id` the kept input column: verify says so (exit 1), rather than
    that the sampled ids are missing from the inputs."""
    out = tmp_path / "o.parquet"
    rc, log, _ = policyscan("score", logs, "-o", out, "--no-progress", "--id-column", "uid")
    assert rc == 0, log
    meta = read_metadata(out)
    meta["read"]["keep"] = ["id"]
    pq.write_table(pq.read_table(out).replace_schema_metadata({b"policyscan": json.dumps(meta).encode()}), out)
    assert read_metadata(out)["read"]["keep"] == ["id"]
    rc, log, _ = policyscan("verify", out)
    assert rc == 1 and f"{out}: its 'id' column holds the input column 'id'" in log and "--id-column uid" in log, log
    assert "Traceback" not in log


def test_sample_logs_still_keep_their_columns(tmp_path):
    """The sample's own command with a kept column that is free: no false alarm."""
    out = tmp_path / "o.jsonl"
    rc, log, _ = policyscan("score", SAMPLE / "conversations.jsonl", "-o", out, "--no-progress", "--keep", "messages")
    assert rc == 0, log
    assert list(json.loads(out.read_text().splitlines()[0])) == ["id", "messages", "p_investment_advice", "p_pii"]
