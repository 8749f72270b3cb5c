"""Write scores and errors atomically: temporary names, renamed into place only when complete."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError

META_KEY = b"policyscan"


def _tmp(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


class ScoreWriter:
    """Rows in input order: id, kept columns, p_<policy> (and f_<policy> with raw), wide or long."""

    def __init__(self, path: Path, fmt: str, layout: str, policies: list[str], raw: bool):
        if fmt not in ("parquet", "jsonl") or layout not in ("wide", "long"):
            raise ValueError(f"format {fmt!r} / layout {layout!r}")
        self.path, self.fmt, self.layout, self.policies, self.raw = path, fmt, layout, policies, raw
        self.tmp = _tmp(path)
        self.rows = 0
        self._pq: pq.ParquetWriter | None = None
        self._fh = open(self.tmp, "w", encoding="utf-8") if fmt == "jsonl" else None

    def write(self, ids: pa.Array, keep: dict[str, pa.Array], p: np.ndarray, f: np.ndarray) -> None:
        """p, f: [rows, policies] for the scored rows of one chunk, in input order."""
        table = self._table(ids, keep, p, f)
        self.rows += len(ids)
        if self._fh is not None:
            for rec in table.to_pylist():
                self._fh.write(json.dumps(rec, default=str) + "\n")
            return
        if self._pq is None:
            self._pq = pq.ParquetWriter(self.tmp, table.schema)
            self._schema = table.schema
        elif table.schema != self._schema:
            try:
                table = table.cast(self._schema)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as e:
                raise InputError(f"column types differ between inputs written to one output ({e}); "
                                 "write each input to its own output with -o DIR") from e
        self._pq.write_table(table)

    def _table(self, ids, keep, p, f) -> pa.Table:
        cols: dict[str, pa.Array | np.ndarray] = {"id": ids, **keep}
        if self.layout == "wide":
            for j, name in enumerate(self.policies):
                cols[f"p_{name}"] = p[:, j]
            if self.raw:
                for j, name in enumerate(self.policies):
                    cols[f"f_{name}"] = f[:, j]
            return pa.table(cols)
        n, k = p.shape
        rep = pa.array(np.repeat(np.arange(n), k))
        long = {c: v.take(rep) if isinstance(v, (pa.Array, pa.ChunkedArray)) else v for c, v in cols.items()}
        long["policy"] = pa.array(np.tile(np.array(self.policies, dtype=object), n), pa.string())
        long["p"] = p.reshape(-1)
        if self.raw:
            long["f"] = f.reshape(-1)
        return pa.table(long)

    def commit(self, meta: dict) -> None:
        """Record metadata, close, and rename into place (a reader never sees half a file)."""
        blob = json.dumps(meta, sort_keys=True)
        if self._fh is not None:
            self._fh.close()
            _atomic_text(meta_path(self.path), blob)
        else:
            if self._pq is None:  # no scored rows: still a valid, empty file with the full schema
                empty = np.zeros((0, len(self.policies)))
                self._pq = pq.ParquetWriter(self.tmp, self._table(pa.array([], pa.string()), {}, empty, empty).schema)
            self._pq.add_key_value_metadata({META_KEY: blob.encode()})
            self._pq.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
        if self._pq is not None:
            self._pq.close()
        self.tmp.unlink(missing_ok=True)


def meta_path(out: Path) -> Path:
    """JSONL outputs carry their metadata beside them; Parquet ones inside."""
    return out.with_name(out.name + ".meta.json")


def read_metadata(out: Path) -> dict | None:
    """The metadata a finished output carries, or None if it has none or cannot be read."""
    try:
        if out.name.endswith(".parquet"):
            kv = pq.ParquetFile(out).metadata.metadata or {}
            return json.loads(kv[META_KEY]) if META_KEY in kv else None
        mp = meta_path(out)
        return json.loads(mp.read_text()) if mp.is_file() else None
    except (OSError, ValueError, pa.ArrowException):
        return None


class ErrorWriter:
    """JSONL, one line per row that could not be scored: file, row, line, id, reason."""

    def __init__(self, path: Path):
        self.path, self.tmp, self.count = path, _tmp(path), 0
        self._fh = None

    def add(self, file: str, row: int | None, line: int | None, id_, reason: str) -> None:
        if self._fh is None:
            self._fh = open(self.tmp, "w", encoding="utf-8")
        self._fh.write(json.dumps({"file": file, "row": row, "line": line, "id": id_, "reason": reason},
                                  default=str) + "\n")
        self.count += 1

    def commit(self) -> None:
        if self._fh is None:
            self.path.unlink(missing_ok=True)  # a stale errors file from an earlier run would mislead
            return
        self._fh.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
        self.tmp.unlink(missing_ok=True)


def _atomic_text(path: Path, text: str) -> None:
    tmp = _tmp(path)
    tmp.write_text(text)
    os.replace(tmp, path)
