"""Units of work for the worker processes (engine/workers.py): a slice of a Parquet row group, or a whole file.

A unit's rows come out as the single-process reader (sources.read_chunks) gives them: the same ids (file:row
counted from the file's first row), the same error rows and reasons, a damaged row group's lost rows included.
Only where chunks begin differs, and no score depends on that (the engine is batch-invariant)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from policyscan.engine.errors import InputError
from policyscan.engine.pipeline import FileFailure, encode_chunk
from policyscan.engine.rows import Chunk, ReadSpec
from policyscan.engine.runner import Engine
from policyscan.engine.sources import (Lost, ParquetLayout, _lost, layout_chunk, parquet_layout,
                                      read_chunks)

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


def plan_units(inputs: list[Path], spec: ReadSpec, unit_rows: int = UNIT_ROWS) -> list[Unit]:
    """The run's units in input order: Parquet row groups cut into slices of at most `unit_rows` rows (read
    from the footers only); JSONL files, and Parquet files that cannot be opened or lack a column, whole."""
    if unit_rows < 1:
        raise ValueError(f"unit_rows must be at least 1, got {unit_rows}")
    units: list[Unit] = []
    for path in inputs:
        try:
            meta = parquet_layout(path, spec).file.metadata if path.name.endswith(".parquet") else None
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
            yield encode_chunk(engine, chunk)
    except InputError as e:
        yield FileFailure(unit.path, e, done)


def _slice_chunks(unit: Unit, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    lay = parquet_layout(unit.path, spec)
    for row, item in _slice_batches(unit, lay, spec.chunk_rows):
        if isinstance(item, pa.RecordBatch):
            yield layout_chunk(unit.path, row, [item], lay, spec, render)
        else:
            yield _lost(unit.path, row, *item, lay.file.schema_arrow, lay.id_column, spec.keep)


def _slice_batches(unit: Unit, lay: ParquetLayout, size: int) -> Iterator[tuple[int, pa.RecordBatch | Lost]]:
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
