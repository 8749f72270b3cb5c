"""What `score --ray` checks of the rows Ray returns (policyscan.ray.returned): every unit's rows in order, each
once, closed by the reader's end row or a failed row that counts them; a row lost or doubled by a retried batch
fails the output by name instead of leaving a short output whose row accounting still balances. No Ray needed."""
from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.inputs.units import plan_units
from policyscan.ray.read import SOURCE, unit_tables
from policyscan.ray.returned import ReturnedRows


@pytest.fixture
def units(tmp_path):
    """A Parquet file of 3 row groups (slices of known rows: file rows 0-4, 5-9, 10-11), then a small JSONL file
    (one unit, read whole), and an empty JSONL file."""
    pq.write_table(pa.table({"id": [f"r{i}" for i in range(12)], "text": [f"t{i}" for i in range(12)]}),
                   tmp_path / "a.parquet", row_group_size=5)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"id": f"j{i}", "text": "x"}) + "\n" for i in range(4)))
    (tmp_path / "c.jsonl").write_text("")
    return plan_units([tmp_path / "a.parquet", tmp_path / "b.jsonl", tmp_path / "c.jsonl"], ReadSpec())


def returned(units, spec=ReadSpec()) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(unit, row, closes) of each unit's rows as the packed reader gives them (its chunks, then its end row)."""
    out = []
    for u in units:
        parts = []
        for t in unit_tables(u, spec, str, ends=True):
            src = t.column(SOURCE).combine_chunks()
            failed, end = (src.field(k).to_numpy(zero_copy_only=False) for k in ("failed", "end"))
            parts.append((src.field("unit").to_numpy(), src.field("row").to_numpy(), failed | end))
        out.append(tuple(np.concatenate(x) for x in zip(*parts)))
    return out


def check(units, tables) -> None:
    seen = ReturnedRows(units)
    for unit, row, closes in tables:
        seen.see(unit, row, closes)
    seen.finish()


def test_every_unit_back_whole_passes_and_each_closes_with_its_count(units):
    tables = returned(units)
    assert len(units) == 5 and [u.part is None for u in units] == [False, False, False, True, True]
    closing = [(int(u[-1]), int(r[-1])) for u, r, c in tables if c[-1]]
    assert closing == [(0, 5), (1, 5), (2, 2), (3, 4), (4, 0)]  # the empty file's unit closes too, with 0 rows
    check(units, tables)
    # one table of everything, and every row alone: where Ray cuts its blocks does not matter
    check(units, [tuple(np.concatenate(x) for x in zip(*tables))])
    check(units, [(u[i:i + 1], r[i:i + 1], c[i:i + 1]) for u, r, c in tables for i in range(len(u))])


@pytest.mark.parametrize("fault, message", [
    ("lose the last row of a slice", "file row 5 came back with 4 of its 5 rows"),
    ("lose a middle row of the whole file", "file row 0 came back with rows out of place"),
    ("lose the end row of the last unit", "c.jsonl: the part from file row 0 never came back"),
    ("lose a whole unit", "file row 5 never came back"),
    ("double a table", "came back twice"),
    ("swap two units", "file row 5 never came back"),
    ("lose the end row of a slice", "file row 5 never came back whole"),
])
def test_a_row_lost_or_doubled_fails_the_output_naming_the_file(units, fault, message):
    tables = returned(units)
    if fault == "lose the last row of a slice":
        u, r, c = tables[1]
        tables[1] = (np.delete(u, -2), np.delete(r, -2), np.delete(c, -2))
    elif fault == "lose a middle row of the whole file":
        u, r, c = tables[3]
        tables[3] = (np.delete(u, 1), np.delete(r, 1), np.delete(c, 1))
    elif fault == "lose the end row of the last unit":
        tables = tables[:-1]
    elif fault == "lose a whole unit":
        tables = [t for t in tables if t[0][0] != 1]
    elif fault == "double a table":
        tables.insert(1, tables[0])
    elif fault == "swap two units":
        tables[1], tables[2] = tables[2], tables[1]
    elif fault == "lose the end row of a slice":
        u, r, c = tables[1]
        tables[1] = (u[:-1], r[:-1], c[:-1])
    with pytest.raises(PolicyscanError, match=message) as e:
        check(units, tables)
    assert "the output is not written" in str(e.value)


def test_a_failed_row_closes_its_unit_with_the_rows_read_before_it(units, tmp_path):
    """A file that cannot be read (further) ends its unit with a failed row, which counts as the unit's close."""
    import gzip

    bad = tmp_path / "cut.jsonl.gz"
    data = gzip.compress("".join(json.dumps({"id": f"g{i}", "text": "x" * 50}) + "\n" for i in range(400)).encode())
    bad.write_bytes(data[: len(data) // 2])  # truncated: the lines before the cut are read, then the file fails
    (bad_unit,) = plan_units([bad], ReadSpec(chunk_rows=16))
    tables = returned([bad_unit], ReadSpec(chunk_rows=16))
    check([bad_unit], tables)
    (unit, row, closes), = tables
    assert closes.sum() == 1 and closes[-1] and 0 < row[-1] == len(row) - 1  # the failure counts the rows before it
    last = list(unit_tables(bad_unit, ReadSpec(chunk_rows=16), str, ends=True))[-1].column(SOURCE).to_pylist()
    assert [(x["failed"], x["end"]) for x in last] == [(True, False)]  # a failure, not an end row


def test_rows_of_another_output_or_after_the_end_are_refused(units):
    tables = returned(units)
    with pytest.raises(PolicyscanError, match="not this output's"):
        check(units[:3], tables)
    u, r, c = tables[0]
    with pytest.raises(PolicyscanError, match="rows after its end"):
        check(units, [(np.append(u, u[0]), np.append(r, 5), np.append(c, False)), *tables[1:]])
