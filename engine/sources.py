"""Open Parquet / JSONL(.gz) files, directories and globs -> chunks of conversations, bounded memory.

Every input row comes out of here exactly once: as a conversation text, or with the reason it cannot be
scored. JSONL is read line by line (polars and pyarrow lose exact line numbers on a malformed line)."""
from __future__ import annotations

import glob
import gzip
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from .errors import InputError

SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".ndjson", ".json")
TEXT_GUESSES = ("text", "conversation", "transcript")
MESSAGES_GUESSES = ("messages", "conversation", "turns")


@dataclass(frozen=True)
class ReadSpec:
    text_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    keep: tuple[str, ...] = ()
    chunk_rows: int = 4096
    chunk_chars: int = 16 << 20  # a JSONL chunk also ends at this much text: huge rows keep memory bounded
    max_chars: int = 1 << 20  # a conversation longer than this keeps its tail (tokens are cut from the left anyway)

    def __post_init__(self) -> None:
        if self.text_column and self.messages_column:
            raise InputError("give --text-column or --messages-column, not both")


@dataclass
class Chunk:
    """Consecutive rows of one file. texts[i] is None exactly when errors[i] says why."""

    path: str
    first_row: int
    ids: pa.Array  # the id column as stored (Parquet), strings (JSONL), or "file:row" when there is none
    texts: list[str | None]
    errors: list[str | None]
    lines: list[int] | None = None  # 1-based line numbers (JSONL)
    keep: dict[str, pa.Array] = field(default_factory=dict)
    clipped: int = 0  # conversations longer than max_chars, kept from the tail

    def __len__(self) -> int:
        return len(self.errors)


def expand_inputs(inputs: list[str]) -> list[Path]:
    """Files, directories (their supported files, sorted) and globs -> files, in the order given."""
    out: list[Path] = []
    for item in inputs:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.is_file() and f.name.endswith(SUFFIXES))
            if not found:
                raise InputError(f"{p}: directory holds no {', '.join(SUFFIXES)} files")
            out += found
        elif p.is_file():
            out.append(p)
        elif any(c in item for c in "*?["):
            found = sorted(Path(f) for f in glob.glob(item, recursive=True) if Path(f).is_file())
            if not found:
                raise InputError(f"{item}: the pattern matches no files")
            out += found
        else:
            raise InputError(f"{item}: no such file or directory")
    return out


def read_chunks(path: Path, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    """Chunks of one file. A file that cannot be opened raises InputError naming it."""
    name = path.name
    if name.endswith(".parquet"):
        yield from _parquet(path, spec, render)
    elif name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json")):
        yield from _jsonl(path, spec, render)
    else:
        raise InputError(f"{path}: unknown format; policyscan reads {', '.join(SUFFIXES)}")


def _pick(spec: ReadSpec, columns: list[str], path: Path) -> tuple[str, bool]:
    """(column, is_messages) from the spec, or guessed from the names present."""
    if spec.text_column or spec.messages_column:
        col = spec.text_column or spec.messages_column
        if col not in columns:
            raise InputError(f"{path}: no column {col!r}; it has {columns}")
        return col, spec.messages_column is not None
    for guess in TEXT_GUESSES + MESSAGES_GUESSES:
        if guess in columns:
            return guess, guess in MESSAGES_GUESSES and guess not in TEXT_GUESSES
    raise InputError(f"{path}: no conversation column found among {columns}; "
                     "name it with --text-column or --messages-column")


def conversation(value, is_messages: bool, render: Callable[[list], str]) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason): one cell of the conversation column checked and rendered."""
    if value is None:
        return None, "null conversation"
    if is_messages:
        if isinstance(value, str):
            return None, "messages column holds a string, expected a list of {role, content}"
        if not isinstance(value, list) or not value:
            return None, f"messages must be a non-empty list of {{role, content}}, got {type(value).__name__}"
        for j, m in enumerate(value):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                return None, f"message {j} is not a {{role: str, content: str}} object: {str(m)[:80]!r}"
        try:
            value = render(value)
        except Exception as e:  # a template error is about this row, not the run
            return None, f"chat template failed: {e}"
    elif not isinstance(value, str):
        return None, f"conversation is {type(value).__name__}, expected a string"
    if not value.strip():
        return None, "empty conversation"
    return value, None


def _clip(texts: list[str | None], limit: int) -> int:
    n = 0
    for i, t in enumerate(texts):
        if t is not None and len(t) > limit:
            texts[i], n = t[-limit:], n + 1
    return n


def _parquet(path: Path, spec: ReadSpec, render) -> Iterator[Chunk]:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e}); is it truncated?") from e
    columns = pf.schema_arrow.names
    col, is_messages = _pick(spec, columns, path)
    id_col = spec.id_column or ("id" if "id" in columns else None)
    for c in ([id_col] if id_col else []) + list(spec.keep):
        if c not in columns:
            raise InputError(f"{path}: no column {c!r}; it has {columns}")
    ftype = pf.schema_arrow.field(col).type
    type_error = None
    if not is_messages and not (pa.types.is_string(ftype) or pa.types.is_large_string(ftype)):
        type_error = f"column {col!r} has type {ftype}, expected string"
    wanted = list(dict.fromkeys([col] + ([id_col] if id_col else []) + list(spec.keep)))
    row = 0
    try:
        for rb in pf.iter_batches(batch_size=spec.chunk_rows, columns=wanted):
            values = rb.column(col).to_pylist()
            pairs = [(None, type_error) if type_error else conversation(v, is_messages, render) for v in values]
            texts = [t for t, _ in pairs]
            ids = rb.column(id_col) if id_col else pa.array([f"{path.name}:{row + i}" for i in range(len(values))])
            keep = {k: rb.column(k) for k in spec.keep}
            yield Chunk(str(path), row, ids, texts, [e for _, e in pairs], None, keep, _clip(texts, spec.max_chars))
            row += len(values)
    except (OSError, pa.ArrowException) as e:
        total = pf.metadata.num_rows
        raise PartialFileError(f"{path}: unreadable from row {row} on ({e}); is it truncated?", row, total) from e


class PartialFileError(InputError):
    """A file that broke after `done` of its `total` rows were delivered."""

    def __init__(self, message: str, done: int, total: int | None):
        super().__init__(message)
        self.done, self.total = done, total


def _jsonl(path: Path, spec: ReadSpec, render) -> Iterator[Chunk]:
    opener = gzip.open if path.name.endswith(".gz") else open
    col_fixed = spec.text_column or spec.messages_column
    row, line_no, chars = 0, 0, 0
    buf: dict[str, list] = {"ids": [], "texts": [], "errors": [], "lines": []}
    keep: dict[str, list] = {k: [] for k in spec.keep}
    picked: tuple[str, bool] | None = (col_fixed, spec.messages_column is not None) if col_fixed else None

    try:
        f = opener(path, "rt", encoding="utf-8", newline="\n")
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e})") from e
    with f:
        try:
            for line_no, line in enumerate(f, 1):
                if not line.strip():
                    continue  # blank lines are not rows
                text, err, obj = None, None, None
                try:
                    obj = json.loads(line)
                    if not isinstance(obj, dict):
                        err = f"line is a JSON {type(obj).__name__}, expected an object"
                except json.JSONDecodeError as e:
                    err = f"malformed JSON ({e.msg} at column {e.colno})"
                if obj is not None and err is None:
                    if picked is None:
                        picked = _pick(spec, list(obj), path)
                    col, is_messages = picked
                    if col not in obj:
                        err = f"no field {col!r}; this line has {list(obj)}"
                    else:
                        text, err = conversation(obj[col], is_messages, render)
                    if spec.id_column and err is None and spec.id_column not in obj:
                        text, err = None, f"no field {spec.id_column!r} (--id-column); this line has {list(obj)}"
                fields = obj if isinstance(obj, dict) else {}
                buf["ids"].append(fields.get(spec.id_column or "id", f"{path.name}:{line_no}"))
                buf["texts"].append(text)
                buf["errors"].append(err)
                buf["lines"].append(line_no)
                for k in spec.keep:
                    keep[k].append(fields.get(k))
                row += 1
                chars += len(line)
                if len(buf["texts"]) >= spec.chunk_rows or chars >= spec.chunk_chars:
                    chars = 0
                    yield _take(path, row, buf, keep, spec)
        except (OSError, EOFError, UnicodeDecodeError) as e:
            if buf["texts"]:
                yield _take(path, row, buf, keep, spec)
            raise PartialFileError(f"{path}: unreadable after line {line_no} ({e}); is it truncated?", row, None) from e
    if buf["texts"]:
        yield _take(path, row, buf, keep, spec)


def _take(path: Path, row: int, buf: dict[str, list], keep: dict[str, list], spec: ReadSpec) -> Chunk:
    """Hand the buffered rows out as a Chunk and start empty buffers."""
    n = len(buf["texts"])
    chunk = Chunk(str(path), row - n, pa.array([_as_str(v) for v in buf["ids"]], pa.string()), buf["texts"],
                  buf["errors"], buf["lines"], {k: pa.array([_as_str(v) for v in vals], pa.string())
                                                for k, vals in keep.items()}, _clip(buf["texts"], spec.max_chars))
    for k in buf:
        buf[k] = []
    for k in keep:
        keep[k] = []
    return chunk


def _as_str(v) -> str | None:
    """JSON values have no fixed type across lines; ids and kept fields become strings (JSON for non-strings)."""
    return v if v is None or isinstance(v, str) else json.dumps(v)
