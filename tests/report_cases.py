"""Shared by the report tests: score outputs of the sample slice with a time column, and the figures a page shows
(its cells' data-* attributes)."""
from __future__ import annotations

import datetime
import re
from html import unescape
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from cli_cases import run

_CELL = re.compile(r"<(?:td|b)([^>]*\bdata-metric=[^>]*)>([^<]*)<")
_ATTR = re.compile(r'data-([a-z-]+)="([^"]*)"')
START = datetime.datetime(2026, 11, 30, 22, tzinfo=datetime.timezone.utc)


def timed_input(root: Path, conversations: Path) -> Path:
    """The sample conversations with a `ts` column, one conversation every two hours from START."""
    t = pq.read_table(conversations)
    ts = pa.array([START + datetime.timedelta(hours=2 * i) for i in range(t.num_rows)], pa.timestamp("us", "UTC"))
    path = root / "timed.parquet"
    pq.write_table(t.append_column("ts", ts), path)
    return path


def score(inp: Path, out: Path, *args) -> Path:
    run("score", inp, "-o", out, "--no-progress", "--max-length", "512", *args, ok=(0, 3))
    return out


def page_figures(html: str) -> dict[tuple, str]:
    """(metric, policy, other attributes...) -> the text of every cell that names what it shows."""
    out = {}
    for attrs, text in _CELL.findall(html):
        d = dict(_ATTR.findall(attrs))
        metric = unescape(d.pop("metric"))
        out[(metric, *(unescape(v) for _, v in sorted(d.items())))] = unescape(text).strip()
    return out


def number(text: str) -> float:
    """The first number of a cell's text ("1,234", "12.5%", "2 (22%)")."""
    return float(text.split()[0].replace(",", "").rstrip("%"))
