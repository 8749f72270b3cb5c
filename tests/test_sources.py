"""Bad input never loses a row: every row comes out as a conversation or with its reason, file and row/line."""
from __future__ import annotations

import gzip
import io
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.sources import PartialFileError, ReadSpec, expand_inputs, read_chunks


def render(value):
    """As content.Conversations with no special tokens: a text as it is, messages as plain lines."""
    return value if isinstance(value, str) else "\n".join(f"{m['role']}: {m['content']}" for m in value)


def rows(path, spec=ReadSpec()):
    out = []
    for c in read_chunks(path, spec, render):
        for i in range(len(c)):
            out.append((c.lines[i] if c.lines else c.first_row + i, c.ids[i].as_py(), c.texts[i], c.errors[i]))
    return out


def test_jsonl_bad_lines_keep_their_line_numbers(tmp_path):
    p = tmp_path / "a.jsonl"
    lines = [json.dumps({"id": 1, "text": "hello"}), "{not json", "", json.dumps({"id": 3, "text": None}),
             json.dumps({"id": 4, "text": "   "}), json.dumps({"id": 5, "text": 42}), json.dumps([1, 2]),
             json.dumps({"id": 7, "other": "x"}), json.dumps({"id": 8, "text": "fine", "extra": {"a": 1}})]
    p.write_text("\n".join(lines) + "\n")
    got = rows(p)
    assert [r[0] for r in got] == [1, 2, 4, 5, 6, 7, 8, 9]  # blank line 3 is not a row
    reasons = {r[0]: r[3] for r in got}
    assert reasons[1] is None and reasons[9] is None
    assert "malformed JSON" in reasons[2]
    assert reasons[4] == "null conversation"
    assert reasons[5] == "empty conversation"
    assert "int, expected a string" in reasons[6]
    assert "JSON list, expected an object" in reasons[7]
    assert "no field 'text'" in reasons[8] and "other" in reasons[8]
    assert got[0][1] == "1"  # JSON ids become strings


def test_messages_column_validation(tmp_path):
    p = tmp_path / "m.jsonl"
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    recs = [{"messages": good}, {"messages": []}, {"messages": "text"}, {"messages": [{"role": "user"}]},
            {"messages": [{"role": "user", "content": 5}]}]
    p.write_text("\n".join(json.dumps(r) for r in recs))
    got = rows(p)
    assert got[0][2] == "user: hi\nassistant: hello" and got[0][3] is None
    assert "non-empty list" in got[1][3]
    assert "holds a string" in got[2][3]
    assert "message 0 has no content" in got[3][3] and "message 0 has content that is neither" in got[4][3]
    assert got[0][1] == "m.jsonl:1"  # no id column: file and line


def test_parquet_types_nulls_and_missing_columns(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": [10, 11, 12], "text": ["a", None, ""], "n": [1, 2, 3]}), p)
    got = rows(p)
    assert [r[3] for r in got] == [None, "null conversation", "empty conversation"]
    assert [r[1] for r in got] == [10, 11, 12]
    with pytest.raises(InputError, match=r"no column 'body'; it has \['id', 'text', 'n'\]"):
        rows(p, ReadSpec(text_column="body"))
    with pytest.raises(InputError, match="no column 'zzz'"):
        rows(p, ReadSpec(keep=("zzz",)))
    q = tmp_path / "b.parquet"
    pq.write_table(pa.table({"text": [1, 2]}), q)
    assert all("has type int64, expected string" in r[3] for r in rows(q))
    r = tmp_path / "c.parquet"
    pq.write_table(pa.table({"body": ["x"]}), r)
    with pytest.raises(InputError, match="no conversation column found among"):
        rows(r)


def test_truncated_parquet_and_garbage(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": ["x" * 100] * 1000}), p, row_group_size=100)
    data = p.read_bytes()
    (tmp_path / "cut.parquet").write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError, match="cut.parquet: not a readable Parquet file.*truncated"):
        rows(tmp_path / "cut.parquet")
    (tmp_path / "g.parquet").write_bytes(b"PAR1 not really")
    with pytest.raises(InputError, match="g.parquet"):
        rows(tmp_path / "g.parquet")


def test_corrupt_row_group_costs_its_own_rows_only(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"text": [f"row {i} " * 20 for i in range(1000)]}), p, row_group_size=100,
                   compression="none")
    meta = pq.ParquetFile(p).metadata
    rg = meta.row_group(5).column(0)
    data = bytearray(p.read_bytes())
    start = rg.data_page_offset
    data[start:start + 64] = b"\xff" * 64  # smash a page header in the 6th row group
    p.write_bytes(bytes(data))
    got = rows(p, ReadSpec(chunk_rows=100))
    assert [r[0] for r in got] == list(range(1000))  # every row once, in order, with its row number
    bad = [r[0] for r in got if r[3] is not None]
    assert bad == list(range(500, 600))
    assert "row group 5 of 10 is unreadable" in got[500][3] and got[500][1] == "t.parquet:500"
    assert got[600][2] == "row 600 " * 20


def test_gzip_and_truncated_gzip(tmp_path):
    p = tmp_path / "a.jsonl.gz"
    with gzip.open(p, "wt") as f:
        for i in range(2000):
            f.write(json.dumps({"id": i, "text": f"conversation {i} " * 10}) + "\n")
    assert len(rows(p)) == 2000
    cut = tmp_path / "cut.jsonl.gz"
    cut.write_bytes(p.read_bytes()[:3000])
    with pytest.raises(PartialFileError, match=r"cut.jsonl.gz: ends after line \d+, before its gzip data does .*: it "
                                               "is truncated"):
        rows(cut)


def test_damaged_gzip_data_scores_no_row_of_the_file(tmp_path):
    """gzip checks a member's CRC only at its end, after the lines decoded from it: a flipped byte (here in the second
    of two members, then in the only one) makes the whole file its error before any row is read. Bytes that are not
    gzip after intact members cost nothing that was read, and say so; zeros after them are padding."""
    good = gzip.compress("".join(json.dumps({"id": i, "text": f"conversation {i} " * 10}) + "\n"
                                 for i in range(1000)).encode())
    p = tmp_path / "a.jsonl.gz"
    p.write_bytes(good + good)
    assert len(rows(p)) == 2000  # two members read as one file
    for data in (good + _flipped(good), _flipped(good)):
        p.write_bytes(data)
        chunks = read_chunks(p, ReadSpec(chunk_rows=10), render)
        with pytest.raises(InputError, match=r"a.jsonl.gz: its gzip data is damaged \(.*\); no row of it can be "
                                             "trusted, so none is scored"):
            next(chunks)
    p.write_bytes(good + b"\0" * 64)
    assert len(rows(p)) == 1000
    p.write_bytes(b"")  # no header: not a gzip file of no lines, which is 20 bytes
    with pytest.raises(InputError, match=r"it is empty \(0 bytes\), not gzip data"):
        rows(p)
    p.write_bytes(gzip.compress(b""))
    assert rows(p) == []
    p.write_bytes(good + b"appended by mistake")
    got = []
    with pytest.raises(PartialFileError, match=r"the bytes after line 1000 are not gzip data .* the lines before "
                                               "them were read"):
        for c in read_chunks(p, ReadSpec(chunk_rows=100), render):
            got += c.texts
    assert len(got) == 1000


def test_a_damaged_member_after_one_that_ends_at_a_read_boundary_is_found():
    """gzip_damage reads in blocks: where a member ends exactly at a block's end, the next member's header is in the
    next block, and it must still be checked (as must members after zero padding)."""
    from policyscan.engine.inputs.jsonl import gzip_damage
    first = gzip.compress(b'{"id": 1, "text": "a"}\n' * 50)
    second = _flipped(gzip.compress(b'{"id": 2, "text": "b"}\n' * 50))

    class Blocks(io.BytesIO):  # reads end where the first member does, as a 4 MiB block can
        def read(self, n=-1):
            return super().read(len(first) if self.tell() == 0 else n)

    for gap in (b"", b"\0" * 3):
        assert "damaged" in gzip_damage(Blocks(first + gap + second))
        assert gzip_damage(Blocks(first + gap + gzip.compress(b"x\n"))) is None


def _flipped(data: bytes) -> bytes:
    bad = bytearray(data)
    bad[len(data) // 2] ^= 0x55
    return bytes(bad)


def test_huge_row_is_clipped_not_dropped(tmp_path):
    p = tmp_path / "h.jsonl"
    p.write_text(json.dumps({"text": "a" * 100 + "TAIL" * 50_000}) + "\n")
    chunk = next(read_chunks(p, ReadSpec(max_chars=1000), render))
    assert chunk.clipped == 1 and chunk.texts[0] == ("TAIL" * 50_000)[-1000:]


def test_expand_inputs(tmp_path):
    (tmp_path / "d").mkdir()
    for n in ("b.jsonl", "a.parquet", "skip.txt"):
        (tmp_path / "d" / n).write_text("")
    assert [p.name for p in expand_inputs([str(tmp_path / "d")])] == ["a.parquet", "b.jsonl"]
    assert [p.name for p in expand_inputs([str(tmp_path / "d" / "*.jsonl")])] == ["b.jsonl"]
    with pytest.raises(InputError, match="no such file"):
        expand_inputs([str(tmp_path / "nope.parquet")])
    with pytest.raises(InputError, match="matches no files"):
        expand_inputs([str(tmp_path / "*.zzz")])
