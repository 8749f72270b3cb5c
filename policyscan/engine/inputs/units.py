"""Units of work for the worker processes (engine/parallel/workers.py) and the Ray pipeline (policyscan.ray): a slice of
a Parquet row group, a range of whole lines of a JSONL file, or a whole file.

A unit's rows come out as the single-process reader (sources.read_chunks) gives them: the same ids (file:row counted
from the file's first row, file:line for JSONL), the same error rows and reasons, a damaged row group's lost rows
included. Only where chunks begin differs, and no score depends on that (the engine is batch-invariant)."""
from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.jsonl import first_column, read_jsonl_range
from policyscan.engine.inputs.rows import Chunk, ReadSpec
from policyscan.engine.inputs.sources import Lost, ParquetLayout, layout_chunk, lost_rows, parquet_layout, read_chunks

# A unit's rows at most: small enough that a large row group is shared out between devices and that its results
# wait in the parent's reorder buffer in little memory, large enough that handing it out costs nothing beside it.
UNIT_ROWS = 16384
# A JSONL unit's bytes, about: the text of a UNIT_ROWS slice of 1 KB conversations.
UNIT_BYTES = 16 << 20
SPLIT_JSONL = (".jsonl", ".ndjson", ".json")  # plain JSONL; a gzipped file cannot be entered midway: it goes whole
_BLOCK = 1 << 20  # bytes the planner reads at a time: lines are counted in C, only maybe-blank ones looked at
# a line that starts with one of these bytes may be blank (only whitespace; str.strip decides, as the reader)
_MAYBE_BLANK = re.compile(rb"\n(?=[\t\n\x0b\x0c\r\x1c-\x20\x80-\xff])")
_ASCII_SPACE = b" \t\r\n\x0b\x0c\x1c\x1d\x1e\x1f"


@dataclass(frozen=True)
class RowSlice:
    """Rows [first, first + rows) of row group `group` (of `groups`) of a Parquet file, whose first row is file
    row `group_row`."""

    group: int
    groups: int
    group_row: int
    first: int
    rows: int

    def __post_init__(self) -> None:
        if not (0 <= self.group < self.groups and self.first >= 0 and self.rows > 0 and self.group_row >= 0):
            raise ValueError(f"no such slice: group {self.group} of {self.groups}, rows {self.first}+{self.rows}, "
                             f"from file row {self.group_row}")

    @property
    def file_rows(self) -> range:
        start = self.group_row + self.first
        return range(start, start + self.rows)


@dataclass(frozen=True)
class LineRange:
    """The whole lines in bytes [start, end) of a plain JSONL file: `rows` rows (its non-blank lines), the first
    on line `first_line` and file row `first_row`; `column` is the conversation column the file's reader picks."""

    start: int
    end: int
    first_line: int
    first_row: int
    rows: int
    column: tuple[str, bool]

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end and self.first_line >= 1 and self.first_row >= 0 and self.rows > 0):
            raise ValueError(f"no such line range: bytes {self.start} to {self.end}, {self.rows} rows from line "
                             f"{self.first_line}, file row {self.first_row}")

    @property
    def file_rows(self) -> range:
        return range(self.first_row, self.first_row + self.rows)


@dataclass(frozen=True)
class Unit:
    """A part of a file (part None: the whole file, whose rows are not known before it is read)."""

    index: int  # the unit's place in the run: the parent writes units in this order
    path: Path
    part: RowSlice | LineRange | None = None

    def __post_init__(self) -> None:
        if self.index < 0:
            raise ValueError(f"a unit's index is its place in the run, got {self.index}")


def plan_units(inputs: list[Path], spec: ReadSpec, unit_rows: int = UNIT_ROWS,
               unit_bytes: int = UNIT_BYTES) -> list[Unit]:
    """The run's units in input order: Parquet row groups cut into slices of at most `unit_rows` rows (read from
    the footers only), plain JSONL files into ranges of whole lines of about `unit_bytes` bytes (one pass that
    counts lines, in bounded memory); gzipped JSONL, and files that cannot be opened, lack a column or fit in one
    unit, whole."""
    if unit_rows < 1 or unit_bytes < 1:
        raise ValueError(f"units need at least 1 row and 1 byte, got {unit_rows} rows, {unit_bytes} bytes")
    units: list[Unit] = []
    for path in inputs:
        try:
            parts = _parts(path, spec, unit_rows, unit_bytes)
        except (InputError, OSError):  # read whole by the worker, which reports it as the single-process path does
            parts = [None]
        units += [Unit(len(units) + i, path, part) for i, part in enumerate(parts)]
    return units


def _parts(path: Path, spec: ReadSpec, unit_rows: int, unit_bytes: int) -> list[RowSlice | LineRange | None]:
    if path.name.endswith(".parquet"):
        meta = parquet_layout(path, spec).file.metadata
        parts: list[RowSlice | LineRange | None] = []
        row = 0
        for g in range(meta.num_row_groups):
            n = meta.row_group(g).num_rows
            parts += [RowSlice(g, meta.num_row_groups, row, first, min(unit_rows, n - first))
                      for first in range(0, n, unit_rows)]
            row += n
        return parts
    if not path.name.endswith(SPLIT_JSONL) or path.stat().st_size <= unit_bytes:
        return [None]
    column = first_column(path, spec)
    ranges = _line_ranges(path, unit_bytes) if column is not None else []
    return [LineRange(*r, column) for r in ranges] if len(ranges) > 1 else [None]


def _line_ranges(path: Path, unit_bytes: int) -> list[tuple[int, int, int, int, int]]:
    """(start, end, first line, first row, rows) of consecutive ranges of whole lines of at least `unit_bytes`
    bytes (the last one less), each with a row; blank lines at the end belong to the last range."""
    ranges: list[tuple[int, int, int, int, int]] = []
    start, line, row = 0, 1, 0  # where the open range begins
    pos, lines, rows = 0, 0, 0  # how far it goes
    for piece in _pieces(path, min(unit_bytes, _BLOCK)):
        pos += len(piece)
        lines += piece.count(b"\n") + (not piece.endswith(b"\n"))
        rows += _rows(piece)
        if pos - start >= unit_bytes and rows:
            ranges.append((start, pos, line, row, rows))
            start, line, row, lines, rows = pos, line + lines, row + rows, 0, 0
    if rows:
        ranges.append((start, pos, line, row, rows))
    elif ranges and pos > start:
        first, _, first_line, first_row, count = ranges[-1]
        ranges[-1] = (first, pos, first_line, first_row, count)
    return ranges


def _pieces(path: Path, block: int, start: int = 0, end: int | None = None) -> Iterator[bytes]:
    """Bytes [start, end) of `path` in pieces of whole lines of about `block` bytes (a line longer than that is
    one piece); the last piece may lack its newline."""
    with open(path, "rb") as f:
        f.seek(start)
        left = (end - start) if end is not None else None
        parts: list[bytes] = []
        while data := f.read(block if left is None else min(block, left)):
            if left is not None:
                left -= len(data)
            cut = data.rfind(b"\n") + 1
            if not cut:
                parts.append(data)
                continue
            yield b"".join([*parts, data[:cut]])
            parts = [data[cut:]]
        if tail := b"".join(parts):
            yield tail


def _rows(piece: bytes) -> int:
    """The rows among a piece's lines: the lines that are not blank (read_jsonl skips those)."""
    starts = [0, *(m.start() + 1 for m in _MAYBE_BLANK.finditer(piece))]
    lines = piece.count(b"\n") + (not piece.endswith(b"\n"))
    return lines - sum(_blank(_line_at(piece, s)) for s in starts)


def _line_at(piece: bytes, start: int) -> bytes:
    end = piece.find(b"\n", start)
    return piece[start:] if end < 0 else piece[start:end]


def _blank(raw: bytes) -> bool:
    """Whether a line is only whitespace, as jsonl.parsed_lines decides on its decoded text."""
    rest = raw.lstrip(_ASCII_SPACE)
    if rest and rest[0] < 0x80:  # an ASCII character that is not whitespace
        return False
    return not rest.decode("utf-8", "surrogateescape").strip()


def range_lines(path: Path, r: LineRange) -> list[int | None]:
    """The line of each of a range's rows; None for every row when the file can no longer say (it changed)."""
    found: list[int] = []
    line = r.first_line
    try:
        for piece in _pieces(path, _BLOCK, r.start, r.end):
            raws = piece.split(b"\n")
            for raw in raws[:-1] if piece.endswith(b"\n") else raws:
                if not _blank(raw):
                    found.append(line)
                line += 1
    except OSError:
        return [None] * r.rows
    return found if len(found) == r.rows else [None] * r.rows


def unit_chunks(unit: Unit, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    """A unit's chunks; raises InputError as sources.read_chunks does (after the chunks read before)."""
    part = unit.part
    if part is None:
        return read_chunks(unit.path, spec, render)
    if isinstance(part, LineRange):
        return read_jsonl_range(unit.path, spec, render, part.start, part.end, part.first_line, part.first_row,
                                part.column)
    return _slice_chunks(unit.path, part, spec, render)


def _slice_chunks(path: Path, part: RowSlice, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    lay = parquet_layout(path, spec)
    for row, item in _slice_batches(path, part, lay, spec.chunk_rows):
        if isinstance(item, pa.RecordBatch):
            yield layout_chunk(path, row, [item], lay, spec, render)
        else:
            yield lost_rows(path, row, *item, lay.file.schema_arrow, lay.id_column, spec.keep)


def _slice_batches(path: Path, part: RowSlice, lay: ParquetLayout,
                   size: int) -> Iterator[tuple[int, pa.RecordBatch | Lost]]:
    """(file row, the slice's part of a record batch), or the slice's rows lost where the group breaks, with
    the message sources._batches gives for the whole group."""
    end, pos = part.first + part.rows, 0
    try:
        for rb in lay.file.iter_batches(batch_size=size, row_groups=[part.group], columns=list(lay.wanted)):
            lo, hi = max(pos, part.first), min(pos + rb.num_rows, end)
            if lo < hi:
                yield part.group_row + lo, rb.slice(lo - pos, hi - lo)
            pos += rb.num_rows
            if pos >= end:
                return
    except (OSError, pa.ArrowException) as e:
        lo = max(pos, part.first)
        if lo < end:
            yield part.group_row + lo, (end - lo, f"{path}: row group {part.group} of {part.groups} is "
                                                  f"unreadable from its row {pos} on ({e}); the other row groups "
                                                  "were read. Is the file damaged?")
