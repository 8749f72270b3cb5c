"""The summary's time split: start-up, load, compile, scoring, writing and the rest, each non-negative, summing
to the whole."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"


def test_summary_splits_the_run_time(tmp_path):
    src = tmp_path / "logs.parquet"
    pq.write_table(pq.read_table(SAMPLE / "conversations.parquet").slice(0, 5), src)
    res = subprocess.run([sys.executable, "-c", "from policyscan.cli.main import main; main()", "score", str(src),
                          "-o", str(tmp_path / "out.parquet"), "--no-progress"], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr
    m = re.search(r"time ([\d.]+) s = start-up ([\d.]+) s \+ load ([\d.]+) s \+ compile ([\d.]+) s \+ scoring "
                  r"([\d.]+) s \+ writing ([\d.]+) s \+ the rest (-?[\d.]+) s", res.stdout + res.stderr)
    assert m, res.stdout + res.stderr
    whole, *parts = map(float, m.groups())
    assert all(p >= 0 for p in parts) and parts[1] > 0 and parts[3] > 0  # writing 5 rows may print 0.00
    assert parts[2] == 0  # the CPU path compiles nothing
    assert abs(sum(parts) - whole) <= 0.035 + 1e-9  # seven figures each rounded to 0.01 s: 0.005 off at most
