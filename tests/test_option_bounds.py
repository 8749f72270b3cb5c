"""Numeric options out of their documented bounds (absurdly large, zero, negative, NaN, inf) are usage errors that
name the option, the value and the range, before anything is read or loaded; EngineSettings refuses the same values
for callers of the library."""
from __future__ import annotations

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE
from test_keep_collisions import policyscan

from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.settings import (
    MAX_BATCH_TOKENS,
    MAX_DEVICES,
    MAX_LENGTH_LIMIT,
    EngineSettings,
    OptionError,
    max_threads,
    max_workers,
)

CPUS = os.cpu_count() or 1
LOGS = SAMPLE / "conversations.parquet"
LABELED = SAMPLE / "labeled.parquet"
PII = SAMPLE / "policies" / "pii"

# (command line after the command's inputs, the option, the text of the range it must name)
SCORE = [
    (["--max-length", str(10**12)], "--max-length", f"2<=x<={MAX_LENGTH_LIMIT}"),
    (["--max-length", "0"], "--max-length", f"2<=x<={MAX_LENGTH_LIMIT}"),
    (["--max-length", "-5"], "--max-length", f"2<=x<={MAX_LENGTH_LIMIT}"),
    (["--batch-tokens", str(10**15)], "--batch-tokens", f"2<=x<={MAX_BATCH_TOKENS}"),
    (["--batch-tokens", "0"], "--batch-tokens", f"2<=x<={MAX_BATCH_TOKENS}"),
    (["--batch-tokens", "9" * 5000], "--batch-tokens", "not a valid integer"),
    (["--threads", "100000"], "--threads", f"1<=x<={4 * CPUS}"),
    (["--threads", "0"], "--threads", f"1<=x<={4 * CPUS}"),
    (["--threads", "-1"], "--threads", f"1<=x<={4 * CPUS}"),
    (["--workers", "100000", "--device", "cpu"], "--workers", f"1<=x<={2 * CPUS}"),
    (["--workers", "0"], "--workers", f"1<=x<={2 * CPUS}"),
    (["--fp8-flip-limit", "nan"], "--fp8-flip-limit", "0<=x<=1"),
    (["--fp8-flip-limit", "inf"], "--fp8-flip-limit", "0<=x<=1"),
    (["--fp8-flip-limit", "-0.1"], "--fp8-flip-limit", "0<=x<=1"),
    (["--fp8-flip-limit", "1.5"], "--fp8-flip-limit", "0<=x<=1"),
    (["--devices", "100000"], "--devices", f"a count of 1 to {MAX_DEVICES}"),
    (["--devices", "0"], "--devices", f"a count of 1 to {MAX_DEVICES}"),
    (["--devices", "-1"], "--devices", f"a count of 1 to {MAX_DEVICES}"),
    (["--devices", "0,00"], "--devices", "distinct GPU indices"),
    (["--devices", "1,x"], "--devices", "distinct GPU indices"),
    (["--devices", f"0,{MAX_DEVICES}"], "--devices", f"below {MAX_DEVICES}"),
    (["--device", "cuda:99999999999"], "--device", f"cuda:N (N below {MAX_DEVICES})"),
]
CALIBRATE = [
    (["--holdout", "nan"], "--holdout", "0.0<=x<=0.9"),
    (["--holdout", "inf"], "--holdout", "0.0<=x<=0.9"),
    (["--holdout", "-0.1"], "--holdout", "0.0<=x<=0.9"),
    (["--holdout", "0.95"], "--holdout", "0.0<=x<=0.9"),
    (["--max-length", str(10**12)], "--max-length", f"2<=x<={MAX_LENGTH_LIMIT}"),
    (["--batch-tokens", "-3"], "--batch-tokens", f"2<=x<={MAX_BATCH_TOKENS}"),
    (["--threads", "100000"], "--threads", f"1<=x<={4 * CPUS}"),
    (["--fp8-flip-limit", "nan"], "--fp8-flip-limit", "0<=x<=1"),
]
VERIFY = [
    (["--sample", "0"], "--sample", "1<=x<=1048576"),
    (["--sample", "-1"], "--sample", "1<=x<=1048576"),
    (["--sample", str(10**12)], "--sample", "1<=x<=1048576"),
    (["--device", "cuda:100"], "--device", f"cuda:N (N below {MAX_DEVICES})"),
]


def refused(rc: int, log: str, seconds: float, option: str, bound: str, value: str) -> None:
    assert rc == 2 and f"Invalid value for '{option}'" in log and bound in log, log
    assert value[:20] in log and "Traceback" not in log
    assert seconds < 30  # click refuses it while parsing: nothing is read or loaded


@pytest.mark.parametrize("args,option,bound", SCORE, ids=[" ".join(a)[:40] for a, _, _ in SCORE])
def test_score_refuses_an_option_out_of_bounds(tmp_path, args, option, bound):
    out = tmp_path / "o.parquet"
    rc, log, seconds = policyscan("score", LOGS, "-o", out, "--no-progress", *args)
    refused(rc, log, seconds, option, bound, args[1])
    assert not out.exists()


@pytest.mark.parametrize("args,option,bound", CALIBRATE, ids=[" ".join(a)[:40] for a, _, _ in CALIBRATE])
def test_calibrate_refuses_an_option_out_of_bounds(tmp_path, args, option, bound):
    rc, log, seconds = policyscan("calibrate", LABELED, "--policy", PII, "--dry-run", *args)
    refused(rc, log, seconds, option, bound, args[1])


@pytest.mark.parametrize("args,option,bound", VERIFY, ids=[" ".join(a) for a, _, _ in VERIFY])
def test_verify_refuses_an_option_out_of_bounds(tmp_path, args, option, bound):
    out = tmp_path / "o.parquet"
    out.write_bytes(b"")  # verify refuses the option before it opens the output
    rc, log, seconds = policyscan("verify", out, *args)
    refused(rc, log, seconds, option, bound, args[1])


def test_help_documents_the_bounds():
    rc, log, _ = policyscan("score", "--help")
    assert rc == 0
    flat = " ".join(log.split())
    for bound in (f"2<=x<={MAX_LENGTH_LIMIT}", f"2<=x<={MAX_BATCH_TOKENS}", f"1<=x<={4 * CPUS}",
                  f"1<=x<={2 * CPUS}", "0<=x<=1", f"N up to {MAX_DEVICES}"):
        assert bound in flat, bound


@pytest.mark.parametrize("kwargs,option", [
    ({"max_length": 10**12, "batch_tokens": 10**12}, "--max-length"),
    ({"max_length": 1}, "--max-length"),
    ({"batch_tokens": 10**15}, "--batch-tokens"),
    ({"batch_tokens": -1}, "--batch-tokens"),
    ({"batch_tokens": 65536.0}, "--batch-tokens"),
    ({"batch_tokens": True}, "--batch-tokens"),
    ({"threads": 0}, "--threads"),
    ({"threads": 100000}, "--threads"),
    ({"fp8_flip_limit": float("nan")}, "--fp8-flip-limit"),
    ({"fp8_flip_limit": float("inf")}, "--fp8-flip-limit"),
    ({"fp8_flip_limit": -0.5}, "--fp8-flip-limit"),
    ({"device": "cuda:abc"}, "--device"),
    ({"device": f"cuda:{MAX_DEVICES}"}, "--device"),
    ({"precision": "fp4"}, "--precision"),
])
def test_engine_settings_refuse_what_the_command_line_refuses(kwargs, option):
    with pytest.raises(OptionError, match=option):
        EngineSettings(**kwargs)


def test_engine_settings_take_the_bounds_themselves():
    s = EngineSettings(max_length=MAX_LENGTH_LIMIT, batch_tokens=MAX_BATCH_TOKENS, threads=max_threads(),
                       fp8_flip_limit=1, device=f"cuda:{MAX_DEVICES - 1}")
    assert s.batch_tokens == MAX_BATCH_TOKENS
    assert EngineSettings(batch_tokens=np.int64(4096), max_length=2).batch_tokens == 4096  # an integer of numpy
    assert max_workers() == 2 * CPUS and max_threads() == 4 * CPUS


def test_verify_names_recorded_settings_it_cannot_run_again(tmp_path):
    """An output whose metadata records settings out of bounds (edited, or older): verify says which and exits 1."""
    out = tmp_path / "o.parquet"
    src = tmp_path / "logs.parquet"
    pq.write_table(pq.read_table(LOGS).slice(0, 3), src)
    rc, log, _ = policyscan("score", src, "-o", out, "--no-progress", "--device", "cpu")
    assert rc == 0, log
    meta = read_metadata(out)
    meta["settings"]["batch_tokens"] = 10**15
    pq.write_table(pq.read_table(out).replace_schema_metadata({b"policyscan": json.dumps(meta).encode()}), out)
    rc, log, _ = policyscan("verify", out)
    assert rc == 1 and f"{out}: the recorded settings cannot be run again: --batch-tokens must be in" in log, log
    assert str(10**15) in log and "Traceback" not in log
