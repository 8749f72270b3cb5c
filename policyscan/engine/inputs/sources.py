"""Open Parquet / JSONL(.gz) files, directories and globs -> chunks of conversations, bounded memory.

Every input row comes out of here exactly once: as a conversation text, or with the reason it cannot be
scored. Parquet is read row group by row group, so a damaged group costs its own rows only. A path that is not a
regular file (a FIFO, a device, a dangling link, ...) is refused before it is opened: an InputError that names it
and says what it is, which the pipeline lists in the errors file as it lists any file that cannot be read."""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.files import check_regular

# the CLI finds its inputs through this module
from policyscan.engine.inputs.discover import SUFFIXES, expand_inputs  # noqa: F401
from policyscan.engine.inputs.jsonl import read_jsonl

# public here: the readers' types
from policyscan.engine.inputs.rows import (  # noqa: F401
    Chunk,
    PartialFileError,
    ReadSpec,
    clip,
    conversation,
    id_type_error,
    pick_column,
)

Lost = tuple[int, str]  # rows of a row group that could not be read, and why


def read_chunks(path: Path, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    """Chunks of one file. A file that cannot be opened, or is not a regular file, raises InputError naming it."""
    name = path.name
    if name.endswith(".parquet"):
        yield from _parquet(path, spec, render)
    elif name.endswith((".jsonl", ".jsonl.gz", ".ndjson", ".json")):
        yield from read_jsonl(path, spec, render)
    else:
        check_regular(path)  # what a path is tells more than its name
        raise InputError(f"{path}: unknown format; policyscan reads {', '.join(SUFFIXES)}")


@dataclass(frozen=True)
class ParquetLayout:
    """A Parquet file opened and checked: the conversation column, the id column, the columns read."""

    file: pq.ParquetFile
    column: str
    is_messages: bool
    id_column: str | None
    type_error: str | None  # why the text column holds no strings (every row an error), or None
    wanted: tuple[str, ...]


def parquet_layout(path: Path, spec: ReadSpec) -> ParquetLayout:
    """The file opened (only a regular file: Arrow would wait on a FIFO for a writer) and its columns checked."""
    check_regular(path)
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e}); is it truncated?") from e
    schema = pf.schema_arrow
    twice = sorted(n for n, k in Counter(schema.names).items() if k > 1)
    if twice:
        raise InputError(f"{path}: the column name(s) {twice} appear more than once; which one holds the data "
                         "cannot be told: write the file with distinct column names")
    col, is_messages = pick_column(spec, schema.names, path)
    id_col = spec.id_column or ("id" if "id" in schema.names else None)
    for c in ([id_col] if id_col else []) + list(spec.keep):
        if c not in schema.names:
            raise InputError(f"{path}: no column {c!r}; it has {schema.names}")
    if id_col and (bad := id_type_error(schema.field(id_col).type, id_col)):
        raise InputError(f"{path}: {bad}")
    wanted = tuple(dict.fromkeys([col] + ([id_col] if id_col else []) + list(spec.keep)))
    for c in wanted:
        if (twice := _repeated_field(schema.field(c).type)) is not None:
            raise InputError(f"{path}: column {c!r} holds a struct that names the field {twice!r} twice; which one "
                             "holds the data cannot be told: write the file with distinct field names")
    type_error = None if is_messages else _text_type_error(schema.field(col).type, col)
    return ParquetLayout(pf, col, is_messages, id_col, type_error, wanted)


def layout_chunk(path: Path, row: int, batches: list[pa.RecordBatch], lay: ParquetLayout, spec: ReadSpec,
                 render) -> Chunk:
    """The rows of `batches`, from file row `row` on, as a Chunk (the workers' units build theirs so too)."""
    table = pa.Table.from_batches(batches)
    values = table.column(lay.column).to_pylist()
    pairs = [(None, lay.type_error) if lay.type_error else conversation(v, lay.is_messages, render) for v in values]
    ids = table.column(lay.id_column).combine_chunks() if lay.id_column else _row_names(path, row, len(values))
    if ids.null_count:  # a row whose id is null names no conversation in the output: its row's error
        null_id = (f"null id (column {lay.id_column!r}); give every row an id, or name another column with "
                   "--id-column")
        pairs = [(None, e or null_id) if missing else (t, e) for (t, e), missing in
                 zip(pairs, ids.is_null().to_pylist())]
    texts = [t for t, _ in pairs]
    keep = {k: table.column(k).combine_chunks() for k in spec.keep}
    return Chunk(str(path), row, ids, texts, [e for _, e in pairs], None, keep, clip(texts, spec.max_chars))


def _parquet(path: Path, spec: ReadSpec, render) -> Iterator[Chunk]:
    lay = parquet_layout(path, spec)
    pending: list[pa.RecordBatch] = []
    row = 0
    for item in _batches(path, lay.file, list(lay.wanted), spec.chunk_rows):
        if isinstance(item, pa.RecordBatch):
            pending.append(item)
            if sum(b.num_rows for b in pending) < spec.chunk_rows:
                continue
        if pending:
            c = layout_chunk(path, row, pending, lay, spec, render)
            pending.clear()
            row += len(c)
            yield c
        if not isinstance(item, pa.RecordBatch):
            c = lost_rows(path, row, *item, lay.file.schema_arrow, lay.id_column, spec.keep)
            row += len(c)
            yield c
    if pending:
        yield layout_chunk(path, row, pending, lay, spec, render)


def _batches(path: Path, pf: pq.ParquetFile, wanted: list[str], size: int) -> Iterator[pa.RecordBatch | Lost]:
    """The file's record batches, one row group at a time; a group that breaks gives the rows it lost
    (counted by the footer) and why."""
    for g in range(pf.num_row_groups):
        n, done = pf.metadata.row_group(g).num_rows, 0
        try:
            for rb in pf.iter_batches(batch_size=size, row_groups=[g], columns=wanted):
                done += rb.num_rows
                yield rb
        except (OSError, pa.ArrowException) as e:
            yield n - done, (f"{path}: row group {g} of {pf.num_row_groups} is unreadable from its row {done} on "
                             f"({e}); the other row groups were read. Is the file damaged?")


def lost_rows(path: Path, row: int, count: int, reason: str, schema: pa.Schema, id_col: str | None,
          keep: tuple[str, ...]) -> Chunk:
    """Rows that could not be read, each one an error row (ids unknown: null)."""
    ids = pa.nulls(count, schema.field(id_col).type) if id_col else _row_names(path, row, count)
    return Chunk(str(path), row, ids, [None] * count, [reason] * count, None,
                 {k: pa.nulls(count, schema.field(k).type) for k in keep})


def _repeated_field(t: pa.DataType) -> str | None:
    """A field name that a struct inside `t` (at any depth: lists, maps, dictionaries) gives twice, or None."""
    if pa.types.is_struct(t):
        names = [t.field(i).name for i in range(t.num_fields)]
        if (twice := next((n for n, k in Counter(names).items() if k > 1), None)) is not None:
            return twice
        inner = [t.field(i).type for i in range(t.num_fields)]
    elif pa.types.is_map(t):
        inner = [t.key_type, t.item_type]
    elif hasattr(t, "value_type"):  # lists of every kind, and dictionaries
        inner = [t.value_type]
    else:
        return None
    return next((r for x in inner if (r := _repeated_field(x)) is not None), None)


def _row_names(path: Path, first: int, count: int) -> pa.Array:
    """Ids for a file without an id column: file:row."""
    return pa.array([f"{path.name}:{first + i}" for i in range(count)], pa.string())


def _text_type_error(t: pa.DataType, col: str) -> str | None:
    """Why a text column's type holds no strings, or None (dictionary-encoded strings are strings)."""
    values = t.value_type if pa.types.is_dictionary(t) else t
    if pa.types.is_string(values) or pa.types.is_large_string(values) or pa.types.is_string_view(values):
        return None
    return f"column {col!r} has type {t}, expected string"
