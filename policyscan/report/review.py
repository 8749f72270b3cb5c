"""A review queue: the rows a person should look at, one per (conversation, policy), with the conversation as its
input held it and an empty `label` column. Once labeled it is labeled data as calibrate and evaluate read it: the
`policy` column says which policy each label is for, and the conversation column is scored as `score` scored it."""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.outputs.sinks import commit_together, meta_path, remove_leftovers, temp_path
from policyscan.report.aggregate import STRATA, Summary
from policyscan.report.excerpts import Conversation
from policyscan.report.kept import Row
from policyscan.report.outputs import FORMATS

REVIEW_KEY = b"policyscan_review"


@dataclass(frozen=True)
class ReviewWritten:
    """What went into the queue: rows written, and rows left out because their conversation was not found."""

    path: Path
    rows: int
    left_out: int


def check_review_path(path: Path) -> None:
    if not path.name.endswith(FORMATS):
        raise InputError(f"--review {path}: name a .parquet, .jsonl or .jsonl.gz file")
    if not path.parent.is_dir():
        raise InputError(f"--review {path}: folder {path.parent} does not exist")


def queue_rows(s: Summary, by: str, limit: int) -> list[tuple[int, Row, str]]:
    """(policy index, row, why it was chosen): per policy the `limit` rows nearest its threshold, or a sample
    drawn from the strata of p in turn (the strata with fewer rows give what they have)."""
    out = []
    for j, pol in enumerate(s.policies):
        if by == "nearest":
            out += [(j, r, "nearest the threshold") for r in pol.near.rows[:limit]]
            continue
        picked: list[tuple[int, Row, str]] = []
        for depth in range(max((len(k.rows) for k in pol.sample), default=0)):
            for i, kept in enumerate(pol.sample):
                if depth < len(kept.rows) and len(picked) < limit:
                    picked.append((j, kept.rows[depth], f"sample of p in [{i / STRATA:.1f}, {(i + 1) / STRATA:.1f})"))
        out += picked
    return out


def write_review(path: Path, s: Summary, by: str, limit: int, conversations: dict, settings: dict) -> ReviewWritten:
    """The queue at `path` (Parquet, or JSONL with its metadata beside it), written under a temporary name and
    renamed into place. `conversations`: (output index, id) -> Conversation."""
    rows, left_out = [], 0
    for j, row, why in queue_rows(s, by, limit):
        conv: Conversation | None = conversations.get((row.output, row.id))
        if conv is None:
            left_out += 1
            continue
        rows.append((j, row, why, conv))
    kinds = {c.is_messages for _, _, _, c in rows}
    if len(kinds) > 1:
        raise InputError("the listed rows come from inputs with text and with messages columns; a labeled file "
                         "has one conversation column: write a review queue for each kind of input")
    column = "messages" if kinds == {True} else "text"
    raw = any(r.f is not None for _, r, _, _ in rows)
    cols: dict[str, list] = {"id": [], "policy": [], "p": [], **({"f": []} if raw else {}), "threshold": [],
                             column: [], "label": [], "selected": [], "output": []}
    for j, row, why, conv in rows:
        pol = s.policies[j]
        cols["id"].append(row.id)
        cols["policy"].append(pol.name)
        cols["p"].append(row.p[j])
        if raw:
            cols["f"].append(None if row.f is None else row.f[j])
        cols["threshold"].append(pol.threshold)
        cols[column].append(conv.value)
        cols["label"].append(None)
        cols["selected"].append(why)
        cols["output"].append(str(s.outputs[row.output].path))
    meta = {"outputs": [str(o.path) for o in s.outputs], "selected_by": by, "rows_per_policy": limit,
            "conversation_column": column, "label_column": "label", **settings}
    _write(path, cols, meta)
    return ReviewWritten(path, len(rows), left_out)


def _write(path: Path, cols: dict[str, list], meta: dict) -> None:
    blob = json.dumps(meta, sort_keys=True, default=str)
    mp = meta_path(path)
    finals = [path] if path.name.endswith(".parquet") else [path, mp]
    remove_leftovers(finals)
    temps = [temp_path(p) for p in finals]
    try:
        if path.name.endswith(".parquet"):
            table = pa.table({k: pa.array(v, pa.string()) if k == "label" else pa.array(v) for k, v in cols.items()})
            pq.write_table(table.replace_schema_metadata({REVIEW_KEY: blob.encode()}), temps[0])
        else:
            opener = gzip.open if path.name.endswith(".gz") else open
            with opener(temps[0], "wt", encoding="utf-8") as fh:
                for i in range(len(cols["id"])):
                    fh.write(json.dumps({k: v[i] for k, v in cols.items()}, default=str) + "\n")
            temps[1].write_text(blob, encoding="utf-8")
        commit_together(list(zip(temps, finals)), [])
    finally:
        for t in temps:
            t.unlink(missing_ok=True)
