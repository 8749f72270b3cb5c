"""policyscan's own readers on Ray: the units of engine/units.py (Parquet row-group slices, JSONL line ranges,
whole files) read by Ray tasks into pyarrow blocks that PolicyScorer takes, with the ids, rows, lines and error
reasons of `policyscan score`.

Ray's read_parquet and read_json do not serve `score --ray`: neither gives a row's place in its file (the ids
file:row and file:line, the errors file's row and line), and pyarrow's JSON reader fails a whole file on one
malformed line, where policyscan lists that line and reads on."""
from __future__ import annotations

import pickle
from collections.abc import Callable, Iterator
from functools import partial

import numpy as np
import pyarrow as pa

from policyscan.engine.chat_template import ChatTemplate
from policyscan.engine.errors import InputError
from policyscan.engine.prompts import NO_TEMPLATE
from policyscan.engine.rows import Chunk, PartialFileError, ReadSpec
from policyscan.engine.units import Unit, unit_chunks

TEXT, ERROR, SOURCE = "_policyscan_text", "_policyscan_error", "_policyscan_source"  # beside the user's columns
# Where a row comes from. failed: the row stands for a file that could not be read from row `row` on (of `total`
# rows, when known), not for an input row: it is listed, and counted, as the single-process path lists a file.
SOURCE_TYPE = pa.struct([("unit", pa.int64()), ("file", pa.string()), ("row", pa.int64()), ("line", pa.int64()),
                         ("failed", pa.bool_()), ("total", pa.int64())])


def read_units(units: list[Unit], spec: ReadSpec, template: ChatTemplate | None):
    """A Ray Dataset of the units' rows, unit by unit: `id` and the kept columns as the reader gives them, the
    conversation rendered as text (TEXT) or why the row has none (ERROR), and where it comes from (SOURCE). For
    PolicyScorer(text_column=TEXT, error_column=ERROR, keep=(..., SOURCE)). template: the run's chat template
    (chat_template.choose_template), which renders a messages column here, in the read tasks."""
    import ray.data

    items = [{"unit": pickle.dumps(u)} for u in units]
    # one unit a block and a read call: a block then holds one file's rows, whose id and kept columns have one type
    return ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        _read, fn_kwargs={"spec": spec, "template": template}, batch_size=1, batch_format="pyarrow")


def _read(batch: pa.Table, spec: ReadSpec, template: ChatTemplate | None) -> Iterator[pa.Table]:
    for blob in batch.column("unit").to_pylist():
        yield from unit_tables(pickle.loads(blob), spec, partial(_render, template))


def unit_tables(unit: Unit, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[pa.Table]:
    """A unit's chunks as tables; a file that cannot be read (further) ends them with a `failed` row."""
    done = 0
    try:
        for chunk in unit_chunks(unit, spec, render):
            done += len(chunk)
            yield _table(unit.index, chunk)
    except InputError as e:
        total = e.total if isinstance(e, PartialFileError) else None
        source = pa.array([{"unit": unit.index, "file": str(unit.path), "row": done, "line": None, "failed": True,
                            "total": total}], SOURCE_TYPE)
        yield pa.table({"id": pa.nulls(1), **{k: pa.nulls(1) for k in spec.keep}, TEXT: pa.nulls(1, pa.string()),
                        ERROR: pa.array([str(e)], pa.string()), SOURCE: source})


def _table(index: int, chunk: Chunk) -> pa.Table:
    n = len(chunk)
    lines = pa.array(chunk.lines, pa.int64()) if chunk.lines else pa.nulls(n, pa.int64())
    source = pa.StructArray.from_arrays(
        [pa.array(np.full(n, index, dtype=np.int64)), pa.array([chunk.path] * n, pa.string()),
         pa.array(np.arange(chunk.first_row, chunk.first_row + n, dtype=np.int64)), lines,
         pa.array(np.zeros(n, dtype=bool)), pa.nulls(n, pa.int64())], fields=list(SOURCE_TYPE))
    return pa.table({"id": chunk.ids, **chunk.keep, TEXT: pa.array(chunk.texts, pa.string()),
                     ERROR: pa.array(chunk.errors, pa.string()), SOURCE: source})


def _render(template: ChatTemplate | None, messages: list[dict]) -> str:
    """As TextEncoder.render: no template is this row's error (the CLI refuses a messages column without one)."""
    if template is None:
        raise InputError(f"{NO_TEMPLATE}; pass --chat-template plain for 'role: content' lines")
    return template.render(messages)
