"""Write scores and errors atomically: temporary names, renamed into place together only when complete."""
from __future__ import annotations

import glob
import gzip
import json
import math
import os
import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.files import open_regular
from policyscan.engine.outputs.columns import check_keep, output_columns

META_KEY = b"policyscan"
ERROR_KEYS = {"file", "row", "line", "id", "reason"}
LINE_LIMIT = 16 << 20  # the longest errors-file line is_errors_file reads
_LEFTOVER = re.compile(r"\.(?P<name>.+)\.(?:tmp|bak)-(?P<pid>\d+)")


def temp_path(path: Path, kind: str = "tmp") -> Path:
    """Where `path` is written before its commit: a hidden name of this process, which remove_leftovers knows."""
    return path.with_name(f".{path.name}.{kind}-{os.getpid()}")


class ScoreWriter:
    """Rows in input order: id, kept columns, p_<policy> (and f_<policy> with raw), wide or long.
    thresholds: add flagged_<policy> (long: flagged) = p >= threshold; truncation: add `truncated`."""

    def __init__(self, path: Path, fmt: str, layout: str, policies: list[str], raw: bool,
                 thresholds: list[float] | None = None, truncation: bool = False):
        if fmt not in ("parquet", "jsonl") or layout not in ("wide", "long"):
            raise ValueError(f"format {fmt!r} / layout {layout!r}")
        self.path, self.fmt, self.layout, self.policies, self.raw = path, fmt, layout, policies, raw
        self.thresholds, self.truncation = thresholds, truncation
        self.columns = output_columns(policies, layout, raw, thresholds is not None, truncation)
        self.tmp = temp_path(path)
        self.rows = 0
        self._pq: pq.ParquetWriter | None = None
        self._fh = None
        if fmt == "jsonl":
            self._fh = (gzip.open(self.tmp, "wt", encoding="utf-8") if path.name.endswith(".gz")
                        else open(self.tmp, "w", encoding="utf-8"))

    def write(self, ids: pa.Array, keep: dict[str, pa.Array], p: np.ndarray, f: np.ndarray,
              cut: np.ndarray | None = None) -> None:
        """p, f, cut (prompt lost tokens): [rows, policies] for the scored rows of one chunk, in input order."""
        check_keep(list(keep), None, self.columns)  # a caller that skipped the check before scoring
        cut = np.zeros(p.shape, dtype=bool) if cut is None else cut
        table = self._table(ids, keep, p, f, cut)
        self.rows += len(ids)
        if self._fh is not None:
            for rec in table.to_pylist():
                self._fh.write(json_line(rec))
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

    def _table(self, ids, keep, p, f, cut) -> pa.Table:
        cols: dict[str, pa.Array | np.ndarray] = {"id": ids, **keep}
        flags = p >= np.asarray(self.thresholds) if self.thresholds is not None else None
        if self.layout == "wide":
            for prefix, values in (("p", p), ("f", f if self.raw else None), ("flagged", flags)):
                if values is not None:
                    cols.update({f"{prefix}_{name}": values[:, j] for j, name in enumerate(self.policies)})
            if self.truncation:
                cols["truncated"] = cut.any(axis=1)
            return pa.table(cols)
        n, k = p.shape
        rep = pa.array(np.repeat(np.arange(n), k))
        long = {c: v.take(rep) if isinstance(v, (pa.Array, pa.ChunkedArray)) else v for c, v in cols.items()}
        long["policy"] = pa.array(np.tile(np.array(self.policies, dtype=object), n), pa.string())
        long["p"] = p.reshape(-1)
        for name, values, on in (("f", f, self.raw), ("flagged", flags, flags is not None),
                                 ("truncated", cut, self.truncation)):
            if on:
                long[name] = values.reshape(-1)
        return pa.table(long)

    def finish(self, meta: dict) -> list[tuple[Path, Path]]:
        """Record metadata and close; the (temporary, final) names to commit."""
        blob = json.dumps(meta, sort_keys=True)
        if self._fh is not None:
            self._fh.close()
            mp = meta_path(self.path)
            temp_path(mp).write_text(blob)
            return [(self.tmp, self.path), (temp_path(mp), mp)]
        if self._pq is None:  # no scored rows: still a valid, empty file with the full schema
            empty = np.zeros((0, len(self.policies)))
            schema = self._table(pa.array([], pa.string()), {}, empty, empty, empty.astype(bool)).schema
            self._pq = pq.ParquetWriter(self.tmp, schema)
        self._pq.add_key_value_metadata({META_KEY: blob.encode()})
        self._pq.close()
        return [(self.tmp, self.path)]

    def abort(self) -> None:
        discard([self._fh, self._pq], [self.tmp] + ([temp_path(meta_path(self.path))] if self.fmt == "jsonl" else []))


def json_line(rec: dict) -> str:
    """One JSONL row. JSON has no NaN or Infinity: a float id or kept value that is one is written as its text
    ("nan"), so that every line parses (scores are always finite: a row whose f is not is an error row)."""
    try:
        return json.dumps(rec, default=str, allow_nan=False) + "\n"
    except ValueError:
        return json.dumps(_finite(rec), default=str, allow_nan=False) + "\n"


def _finite(v):
    """`v` with every NaN or infinite float, at any depth, as its text."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_finite(x) for x in v]
    return v


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


def is_errors_file(path: Path) -> bool:
    """Whether the regular file `path` is an errors file policyscan wrote: every line a {file, row, line, id, reason}
    object, each read to LINE_LIMIT bytes at most (a device or an endless line is never taken for one)."""
    try:
        with open_regular(path) as fh:
            seen = False
            while line := fh.readline(LINE_LIMIT):
                if not line.endswith(b"\n") and len(line) == LINE_LIMIT:
                    return False
                rec = json.loads(line)
                if not isinstance(rec, dict) or set(rec) != ERROR_KEYS:
                    return False
                seen = True
            return seen
    except (InputError, OSError, ValueError, RecursionError):  # RecursionError: JSON nested too deeply for a record
        return False


class ErrorWriter:
    """JSONL, one line per row that could not be scored: file, row, line, id, reason."""

    def __init__(self, path: Path):
        self.path, self.tmp, self.count = path, temp_path(path), 0
        self._fh = None

    def add(self, file: str, row: int | None, line: int | None, id_, reason: str) -> None:
        if self._fh is None:
            self._fh = open(self.tmp, "w", encoding="utf-8")
        self._fh.write(json.dumps({"file": file, "row": row, "line": line, "id": id_, "reason": reason},
                                  default=str) + "\n")
        self.count += 1

    def finish(self) -> tuple[list[tuple[Path, Path]], list[Path]]:
        """(temporary, final) names to commit, and the stale errors file of an earlier run to remove: it
        would mislead beside a clean output (only a file that is an errors file is ever removed)."""
        if self._fh is None:
            return [], [self.path] if is_errors_file(self.path) else []
        self._fh.close()
        return [(self.tmp, self.path)], []

    def abort(self) -> None:
        discard([self._fh], [self.tmp])


def discard(handles: list, temps: list[Path]) -> None:
    """Close what was being written and remove its temporary files. A close that fails (its flush finds the disk
    full) does not keep a file behind: the file is thrown away either way."""
    for h in handles:
        if h is not None:
            try:
                h.close()
            except (OSError, pa.ArrowException):
                pass
    for t in temps:
        t.unlink(missing_ok=True)


def commit_together(moves: list[tuple[Path, Path]], remove: list[Path]) -> None:
    """Rename each finished temporary file into place and remove `remove`: all or nothing. Files replaced or
    removed are first kept under a backup name and put back if any step fails."""
    backups: list[tuple[Path, Path]] = []
    placed: list[Path] = []
    try:
        for final in [f for _, f in moves if f.exists()] + remove:
            backups.append((final, _backup(final)))
        for final in remove:
            final.unlink()
        for tmp, final in moves:
            os.replace(tmp, final)
            placed.append(final)
    except BaseException:
        kept = {final for final, _ in backups}
        for final in placed:
            if final not in kept:
                final.unlink(missing_ok=True)
        for final, bak in backups:
            os.replace(bak, final)
            bak.unlink(missing_ok=True)  # rename() does nothing when both names are links to one file
        raise
    for _, bak in backups:
        bak.unlink(missing_ok=True)


def _backup(path: Path) -> Path:
    """A second name for `path`'s bytes (a hard link; a copy where links are not supported)."""
    bak = temp_path(path, "bak")
    bak.unlink(missing_ok=True)
    try:
        os.link(path, bak)
    except OSError:
        shutil.copy2(path, bak)
    return bak


def remove_leftovers(finals: list[Path]) -> list[Path]:
    """Remove the temporary and backup files that killed runs (SIGKILL, power loss) left for these outputs:
    only names policyscan gives them (.NAME.tmp-PID, .NAME.bak-PID), only of processes no longer alive."""
    removed = []
    for final in finals:
        if not final.parent.is_dir():
            continue
        for cand in final.parent.glob(f".{glob.escape(final.name)}.*-*"):
            m = _LEFTOVER.fullmatch(cand.name)
            if m and m["name"] == final.name and not _alive(int(m["pid"])) and cand.is_file():
                cand.unlink(missing_ok=True)
                removed.append(cand)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        return True  # another user's process (or a name we cannot judge): leave its files
    return True
