"""An output's rows in bounded batches, always wide: ids, p [rows, policies], f when the output has it, and the
time column when one is asked for. The long layout's rows (one per conversation and policy, in policy order) are
regrouped into conversations."""
from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.files import open_regular
from policyscan.report.outputs import ScoredOutput

BATCH_ROWS = 1 << 16


class MissingColumn(InputError):
    """An output without a column the report was asked to read (a time column it did not keep)."""


@dataclass(frozen=True)
class Batch:
    """Consecutive conversations of one output."""

    ids: pa.Array
    p: np.ndarray
    f: np.ndarray | None
    time: pa.Array | None

    def __post_init__(self) -> None:
        n = len(self.ids)
        if self.p.shape[0] != n or (self.f is not None and self.f.shape != self.p.shape) or \
                (self.time is not None and len(self.time) != n):
            raise ValueError("ids, p, f and time must have one row per conversation")


def batches(out: ScoredOutput, time_column: str | None, rows: int = BATCH_ROWS,
            with_f: bool = True) -> Iterator[Batch]:
    """The output's conversations in order, `rows` at a time (the long layout: `rows` of its rows); f only when the
    output has it and `with_f` asks for it."""
    names = list(out.policies)
    wide = out.layout == "wide"
    raw = out.raw and with_f
    value_cols = ([f"p_{n}" for n in names] + ([f"f_{n}" for n in names] if raw else [])) if wide else \
        ["policy", "p"] + (["f"] if raw else [])
    wanted = ["id"] + value_cols + ([time_column] if time_column else [])
    tables = _parquet(out, wanted, rows) if out.path.name.endswith(".parquet") else _jsonl(out, wanted, rows)
    if wide:
        for t in tables:
            yield _wide(t, names, raw, time_column)
        return
    pending: pa.Table | None = None
    k = len(names)
    for t in tables:
        t = t if pending is None else pa.concat_tables([pending, t])
        whole = len(t) // k * k
        if whole:
            yield _regroup(t.slice(0, whole), names, out, raw, time_column)
        pending = t.slice(whole) if whole < len(t) else None
    if pending is not None and len(pending):
        raise InputError(f"{out.path}: its last {len(pending)} rows are not a whole conversation's {k} policy rows; "
                         "the long layout writes one row per policy for each conversation")


def _parquet(out: ScoredOutput, wanted: list[str], rows: int) -> Iterator[pa.Table]:
    pf = pq.ParquetFile(out.path, pre_buffer=False)  # pre-buffering reads ahead of the batches: unbounded
    names = pf.schema_arrow.names
    _check_columns(out, names, wanted)
    for rb in pf.iter_batches(batch_size=rows, columns=wanted):
        yield pa.Table.from_batches([rb])


def _jsonl(out: ScoredOutput, wanted: list[str], rows: int) -> Iterator[pa.Table]:
    """JSONL read line by line (its types are JSON's: ids and kept columns as written)."""
    with open_regular(out.path) as raw:
        data = gzip.GzipFile(fileobj=raw, mode="rb") if out.path.name.endswith(".gz") else raw
        fh = io.TextIOWrapper(data, encoding="utf-8", newline="\n")
        cols: dict[str, list] = {c: [] for c in wanted}
        checked = False
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise InputError(f"{out.path}, line {n}: not JSON ({e.msg}); policyscan writes whole lines, so the "
                                 "file was changed or cut: score it again") from e
            if not checked:
                _check_columns(out, list(rec), wanted)
                checked = True
            for c in wanted:
                cols[c].append(rec.get(c))
            if len(cols["id"]) >= rows:
                yield _table(cols)
                cols = {c: [] for c in wanted}
        if cols["id"]:
            yield _table(cols)


def _table(cols: dict[str, list]) -> pa.Table:
    return pa.table({c: pa.array(v, pa.float64()) if c in ("p", "f") or c.startswith(("p_", "f_")) else pa.array(v)
                     for c, v in cols.items()})


def _check_columns(out: ScoredOutput, names: list[str], wanted: list[str]) -> None:
    missing = [c for c in wanted if c not in names]
    if missing:
        hint = " (score with --keep to pass it through)" if len(missing) == 1 and missing[0] == wanted[-1] else ""
        raise MissingColumn(f"{out.path}: no column {missing[0]!r}{hint}; it has {names}")


def _wide(t: pa.Table, names: list[str], raw: bool, time_column: str | None) -> Batch:
    p = np.stack([_floats(t.column(f"p_{n}")) for n in names], axis=1)
    f = np.stack([_floats(t.column(f"f_{n}")) for n in names], axis=1) if raw else None
    return Batch(t.column("id").combine_chunks(), p, f,
                 t.column(time_column).combine_chunks() if time_column else None)


def _regroup(t: pa.Table, names: list[str], out: ScoredOutput, raw: bool, time_column: str | None) -> Batch:
    k = len(names)
    policy = t.column("policy").to_numpy(zero_copy_only=False).reshape(-1, k)
    if not (policy == np.array(names, dtype=object)).all():
        raise InputError(f"{out.path}: the long layout's policy column is not {', '.join(names)} for each "
                         "conversation in turn; the file was not written by policyscan score or was changed")
    first = pa.array(np.arange(0, len(t), k))
    p = _floats(t.column("p")).reshape(-1, k)
    f = _floats(t.column("f")).reshape(-1, k) if raw else None
    return Batch(t.column("id").take(first).combine_chunks(), p, f,
                 t.column(time_column).take(first).combine_chunks() if time_column else None)


def _floats(col: pa.ChunkedArray) -> np.ndarray:
    return col.to_numpy().astype(np.float64)
