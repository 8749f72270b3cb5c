"""Units of work for the worker processes (engine/workers.py): a slice of a Parquet row group, or a whole file.

A unit's rows come out as the single-process reader (sources.read_chunks) gives them: the same ids (file:row
counted from the file's first row), the same error rows and reasons, a damaged row group's lost rows included.
Only where chunks begin differs, and no score depends on that (the engine is batch-invariant)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.pipeline import FileFailure
from policyscan.engine.rows import Chunk, ReadSpec, clip, conversation, pick_column
from policyscan.engine.runner import Engine
from policyscan.engine.sources import Lost, _lost, _row_names, _text_type_error, read_chunks

# A unit's rows at most: small enough that a large row group is shared out between devices and that its results
# wait in the parent's reorder buffer in little memory, large enough that handing it out costs nothing beside it.
UNIT_ROWS = 16384


@dataclass(frozen=True)
class Unit:
    """Rows [first, first + rows) of row group `group` of a Parquet file, or (group None) a whole file."""

    index: int  # the unit's place in the run: the parent writes units in this order
    path: Path
    group: int | None = None
    groups: int = 0     # the file's row groups (a damaged group's message names them)
    group_row: int = 0  # the file row of the group's first row
    first: int = 0
    rows: int = 0

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"a unit's index is its place in the run, got {self.index}")
        if self.group is not None and not (0 <= self.group < self.groups and self.first >= 0 and self.rows > 0
                                           and self.group_row >= 0):
            raise ValueError(f"{self.path}: no such slice (group {self.group} of {self.groups}, rows "
                             f"{self.first}+{self.rows}, from file row {self.group_row})")

    @property
    def file_rows(self) -> range:
        """The file rows of a slice (a whole file's rows are not known before it is read)."""
        start = self.group_row + self.first
        return range(start, start + self.rows)


@dataclass(frozen=True)
class _Layout:
    """A Parquet file opened and checked as sources._parquet checks it, with the same messages."""

    file: pq.ParquetFile
    column: str
    is_messages: bool
    id_column: str | None
    type_error: str | None
    wanted: tuple[str, ...]


def _layout(path: Path, spec: ReadSpec) -> _Layout:
    try:
        pf = pq.ParquetFile(path)
    except Exception as e:
        raise InputError(f"{path}: not a readable Parquet file ({e}); is it truncated?") from e
    schema = pf.schema_arrow
    col, is_messages = pick_column(spec, schema.names, path)
    id_col = spec.id_column or ("id" if "id" in schema.names else None)
    for c in ([id_col] if id_col else []) + list(spec.keep):
        if c not in schema.names:
            raise InputError(f"{path}: no column {c!r}; it has {schema.names}")
    type_error = None if is_messages else _text_type_error(schema.field(col).type, col)
    wanted = tuple(dict.fromkeys([col] + ([id_col] if id_col else []) + list(spec.keep)))
    return _Layout(pf, col, is_messages, id_col, type_error, wanted)


def plan_units(inputs: list[Path], spec: ReadSpec, unit_rows: int = UNIT_ROWS) -> list[Unit]:
    """The run's units in input order: Parquet row groups cut into slices of at most `unit_rows` rows (read
    from the footers only); JSONL files, and Parquet files that cannot be opened or lack a column, whole."""
    if unit_rows < 1:
        raise ValueError(f"unit_rows must be at least 1, got {unit_rows}")
    units: list[Unit] = []
    for path in inputs:
        try:
            meta = _layout(path, spec).file.metadata if path.name.endswith(".parquet") else None
        except InputError:  # read whole by the worker, which reports it as the single-process path does
            meta = None
        if meta is None:
            units.append(Unit(len(units), path))
            continue
        row = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            for first in range(0, n, unit_rows):
                units.append(Unit(len(units), path, g, meta.num_row_groups, row, first, min(unit_rows, n - first)))
            row += n
    return units


def unit_items(engine: Engine, unit: Unit, spec: ReadSpec) -> Iterator[tuple[Chunk, list] | FileFailure]:
    """A unit's chunks with their conversations encoded, or the failure of its file (as pipeline._encoded)."""
    render = engine.encoder.render
    chunks = read_chunks(unit.path, spec, render) if unit.group is None else _slice_chunks(unit, spec, render)
    done = 0
    try:
        for chunk in chunks:
            done += len(chunk)
            yield _encode(engine, chunk)
    except InputError as e:
        yield FileFailure(unit.path, e, done)


def _encode(engine: Engine, chunk: Chunk) -> tuple[Chunk, list[np.ndarray]]:
    """pipeline._encoded for one chunk: valid conversations tokenized, the texts dropped."""
    keep = max(b.budget for b in engine.builders) + 1
    valid = [i for i, t in enumerate(chunk.texts) if t is not None]
    errors, convs = list(chunk.errors), []
    for i, ids in zip(valid, engine.encoder.encode_batch([chunk.texts[i] for i in valid])):
        if ids:
            convs.append(np.asarray(ids[-keep:], dtype=np.int32))
        else:
            errors[i] = "the conversation encodes to no tokens"
    return dataclasses.replace(chunk, texts=[], errors=errors), convs


def _slice_chunks(unit: Unit, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    lay = _layout(unit.path, spec)
    for row, item in _slice_batches(unit, lay, spec.chunk_rows):
        if isinstance(item, pa.RecordBatch):
            yield _chunk(unit.path, row, item, lay, spec, render)
        else:
            yield _lost(unit.path, row, *item, lay.file.schema_arrow, lay.id_column, spec.keep)


def _slice_batches(unit: Unit, lay: _Layout, size: int) -> Iterator[tuple[int, pa.RecordBatch | Lost]]:
    """(file row, the slice's part of a record batch), or the slice's rows lost where the group breaks, with
    the message sources._batches gives for the whole group."""
    end, pos = unit.first + unit.rows, 0
    try:
        for rb in lay.file.iter_batches(batch_size=size, row_groups=[unit.group], columns=list(lay.wanted)):
            lo, hi = max(pos, unit.first), min(pos + rb.num_rows, end)
            if lo < hi:
                yield unit.group_row + lo, rb.slice(lo - pos, hi - lo)
            pos += rb.num_rows
            if pos >= end:
                return
    except (OSError, pa.ArrowException) as e:
        lo = max(pos, unit.first)
        if lo < end:
            yield unit.group_row + lo, (end - lo, f"{unit.path}: row group {unit.group} of {unit.groups} is "
                                                  f"unreadable from its row {pos} on ({e}); the other row groups "
                                                  "were read. Is the file damaged?")


def _chunk(path: Path, row: int, rb: pa.RecordBatch, lay: _Layout, spec: ReadSpec,
           render: Callable[[list], str]) -> Chunk:
    """sources._parquet's chunk() for one record batch starting at file row `row`."""
    table = pa.Table.from_batches([rb])
    values = table.column(lay.column).to_pylist()
    pairs = [(None, lay.type_error) if lay.type_error else conversation(v, lay.is_messages, render) for v in values]
    texts = [t for t, _ in pairs]
    ids = table.column(lay.id_column).combine_chunks() if lay.id_column else _row_names(path, row, len(values))
    keep = {k: table.column(k).combine_chunks() for k in spec.keep}
    return Chunk(str(path), row, ids, texts, [e for _, e in pairs], None, keep, clip(texts, spec.max_chars))
