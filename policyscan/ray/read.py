"""policyscan's own readers on Ray: the units of engine/inputs/units.py (Parquet row-group slices, JSONL line ranges,
whole files) read by Ray tasks into pyarrow blocks that PolicyScorer takes, with the ids, rows, lines and error
reasons of `policyscan score`.

Ray's read_parquet and read_json do not serve `score --ray`: neither gives a row's place in its file (the ids
file:row and file:line, the errors file's row and line), and pyarrow's JSON reader fails a whole file on one
malformed line, where policyscan lists that line and reads on."""
from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator

import numpy as np
import pyarrow as pa

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.rows import Chunk, PartialFileError, ReadSpec
from policyscan.engine.inputs.units import Unit, unit_chunks
from policyscan.engine.text.content import Conversations

TEXT, ERROR, SOURCE = "_policyscan_text", "_policyscan_error", "_policyscan_source"  # beside the user's columns
PACKED = "_policyscan_chunk"  # read_units(packed=True): a chunk's table as an Arrow IPC stream, one row a chunk
# Where a row comes from. failed: the row stands for a file that could not be read from row `row` on (of `total`
# rows, when known), not for an input row: it is listed, and counted, as the single-process path lists a file.
# end (read_units(packed=True) only): no input row either, but the end of unit `unit`, which gave `row` rows; with a
# failed row, it lets the driver check that every unit came back whole (ray/returned.py).
SOURCE_TYPE = pa.struct([("unit", pa.int64()), ("file", pa.string()), ("row", pa.int64()), ("line", pa.int64()),
                         ("failed", pa.bool_()), ("total", pa.int64()), ("end", pa.bool_())])
END = "end of unit"  # an end row's error: the scorer passes a row with an error through, unscored


def read_units(units: list[Unit], spec: ReadSpec, render: Conversations, packed: bool = False):
    """A Ray Dataset of the units' rows, unit by unit: `id` and the kept columns as the reader gives them, the
    conversation rendered as text (TEXT) or why the row has none (ERROR), and where it comes from (SOURCE). For
    PolicyScorer(text_column=TEXT, error_column=ERROR, keep=(..., SOURCE)). render: the run's conversation texts
    (content.Conversations: its chat template and the tokenizer's special tokens), made here, in the read tasks.

    Files whose id or kept columns differ in type cannot share a batch: Ray Data joins blocks to make a batch of
    map_batches' batch_size, which it requires with GPUs. packed: each chunk of rows as one row of PACKED instead
    (unpack() gives the tables back), so that map_batches(batch_size=1) takes one chunk at a time, as
    `score --ray` does; each unit's chunks are then followed by its end row (SOURCE_TYPE)."""
    import ray.data

    items = [{"unit": pickle.dumps(u)} for u in units]
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read, fn_kwargs={"spec": spec, "render": render, "packed": packed}, batch_size=1,
        batch_format="pyarrow")


def pack(table: pa.Table) -> pa.Table:
    """A table as one row of PACKED (an Arrow IPC stream): any two such rows concatenate, whatever their types."""
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    data = sink.getvalue()
    offsets = pa.py_buffer(np.array([0, data.size], dtype=np.int64))
    return pa.table({PACKED: pa.Array.from_buffers(pa.large_binary(), 1, [None, offsets, data])})


def unpack(batch: pa.Table) -> list[pa.Table]:
    """The tables packed in a batch's PACKED rows, in order."""
    return [pa.ipc.open_stream(chunk[i].as_buffer()).read_all()
            for chunk in batch.column(PACKED).chunks for i in range(len(chunk))]


def _read(batch: pa.Table, spec: ReadSpec, render: Conversations, packed: bool) -> Iterator[pa.Table]:
    for blob in batch.column("unit").to_pylist():
        for table in unit_tables(pickle.loads(blob), spec, render, ends=packed):
            yield pack(table) if packed else table


def unit_tables(unit: Unit, spec: ReadSpec, render: Callable[[list], str], ends: bool = False) -> Iterator[pa.Table]:
    """A unit's chunks as tables; a file that cannot be read (further) ends them with a `failed` row, and with
    `ends` a unit read to its end closes with an end row."""
    done = 0
    try:
        for chunk in unit_chunks(unit, spec, render):
            done += len(chunk)
            yield _table(unit.index, chunk)
    except InputError as e:
        total = e.total if isinstance(e, PartialFileError) else None
        yield _marker(unit, spec, done, str(e), failed=True, total=total)
        return
    if ends:
        yield _marker(unit, spec, done, END, failed=False, total=None)


def _marker(unit: Unit, spec: ReadSpec, done: int, error: str, failed: bool, total: int | None) -> pa.Table:
    """A row that stands for no input row: a unit's failure (`failed`) or its end, after `done` rows."""
    source = pa.array([{"unit": unit.index, "file": str(unit.path), "row": done, "line": None, "failed": failed,
                        "total": total, "end": not failed}], SOURCE_TYPE)
    return pa.table({"id": pa.nulls(1), **{k: pa.nulls(1) for k in spec.keep}, TEXT: pa.nulls(1, pa.string()),
                     ERROR: pa.array([error], pa.string()), SOURCE: source})


def _table(index: int, chunk: Chunk) -> pa.Table:
    n = len(chunk)
    lines = pa.array(chunk.lines, pa.int64()) if chunk.lines else pa.nulls(n, pa.int64())
    source = pa.StructArray.from_arrays(
        [pa.array(np.full(n, index, dtype=np.int64)), pa.array([chunk.path] * n, pa.string()),
         pa.array(np.arange(chunk.first_row, chunk.first_row + n, dtype=np.int64)), lines,
         pa.array(np.zeros(n, dtype=bool)), pa.nulls(n, pa.int64()), pa.array(np.zeros(n, dtype=bool))],
        fields=list(SOURCE_TYPE))
    return pa.table({"id": chunk.ids, **chunk.keep, TEXT: pa.array(chunk.texts, pa.string()),
                     ERROR: pa.array(chunk.errors, pa.string()), SOURCE: source})
