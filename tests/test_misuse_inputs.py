"""The input readers (engine/inputs) on bad input: bad bytes, missing fields, lone surrogates, categorical and
damaged Parquet, policyscan's own outputs, link loops and duplicate inputs. Each bad row costs that row only,
with its line or row number; the sources are tested directly (no model)."""
from __future__ import annotations

import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sources import render, rows

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.sources import ReadSpec, expand_inputs, read_chunks


def test_invalid_utf8_byte_costs_its_line_only(tmp_path):
    p = tmp_path / "a.jsonl"
    lines = [json.dumps({"id": i, "text": f"conversation {i}"}).encode() for i in range(1, 11)]
    lines[2] = b'{"id": 3, "text": "bad \xff byte"}'
    p.write_bytes(b"\n".join(lines) + b"\n")
    got = rows(p)
    assert [r[0] for r in got] == list(range(1, 11))
    assert [r[0] for r in got if r[3] is not None] == [3]
    assert "invalid UTF-8 (byte 0xff at byte 24 of the line)" in got[2][3]
    assert got[9][2] == "conversation 10"


def test_first_line_without_the_text_field_is_one_row_error(tmp_path):
    p = tmp_path / "a.jsonl"
    recs = [{"id": 1, "note": "no text here"}] + [{"id": i, "text": f"t{i}"} for i in range(2, 8)]
    p.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    for chunk_rows in (3, 4096):  # the column is picked from the whole first chunk, not its first line
        got = rows(p, ReadSpec(chunk_rows=chunk_rows))
        assert len(got) == 7 and [r[0] for r in got if r[3] is not None] == [1]
        assert "no field 'text'; this line has ['id', 'note']" in got[0][3]
    only = tmp_path / "b.jsonl"
    only.write_text("\n".join(json.dumps({"body": i}) for i in range(3)) + "\n")
    with pytest.raises(InputError, match=r"no conversation column found among \['body'\] \(the keys of lines 1 to 3\)"):
        rows(only)


def test_first_chunk_of_malformed_lines_does_not_pick_the_column(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text("{oops\n[1]\n" + json.dumps({"text": "fine"}) + "\n")
    got = rows(p, ReadSpec(chunk_rows=2))
    assert [r[3] is None for r in got] == [False, False, True] and got[2][2] == "fine"


def test_lone_surrogates_in_text_id_or_kept_field_are_row_errors(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "a", "text": "hi \\ud800 there", "k": "x"}\n'
                 '{"id": "b\\udc00", "text": "fine", "k": "x"}\n'
                 '{"id": "c", "text": "fine", "k": "\\ud83d"}\n'
                 '{"id": "d", "messages": [{"role": "user", "content": "\\udfff"}]}\n'
                 '{"id": "e", "text": "ok \\ud83d\\ude00", "k": "x"}\n')  # a proper pair is fine
    got = rows(p, ReadSpec(keep=("k",)))
    assert "the conversation holds a lone surrogate \\ud800 at character 3" in got[0][3]
    assert got[1][1] == "b\\udc00" and "the id holds a lone surrogate \\udc00" in got[1][3]
    assert "field 'k' holds a lone surrogate" in got[2][3]
    assert "no field 'text'" in got[3][3]
    assert got[4][3] is None and got[4][2] == "ok \U0001F600"
    msgs = tmp_path / "m.jsonl"
    msgs.write_text('{"messages": [{"role": "user", "content": "\\udfff"}]}\n')
    assert "the conversation holds a lone surrogate \\udfff" in rows(msgs)[0][3]


def test_dictionary_encoded_text_column_is_read(tmp_path):
    p = tmp_path / "cat.parquet"
    texts = pa.array(["a b", "c d", "a b", None]).dictionary_encode()
    pq.write_table(pa.table({"id": [1, 2, 3, 4], "text": texts}), p)
    assert pa.types.is_dictionary(pq.ParquetFile(p).schema_arrow.field("text").type)
    got = rows(p)
    assert [r[2] for r in got] == ["a b", "c d", "a b", None] and got[3][3] == "null conversation"
    q = tmp_path / "catint.parquet"
    pq.write_table(pa.table({"text": pa.array([1, 2]).dictionary_encode()}), q)
    assert all("expected string" in r[3] for r in rows(q))


def test_one_damaged_row_group_of_four_costs_its_50_rows(tmp_path):
    p = tmp_path / "t.parquet"
    pq.write_table(pa.table({"id": list(range(200)), "text": [f"conversation {i} " * 8 for i in range(200)],
                             "k": ["x"] * 200}), p, row_group_size=50, compression="none")
    col = pq.ParquetFile(p).metadata.row_group(2).column(1)
    data = bytearray(p.read_bytes())
    data[col.data_page_offset:col.data_page_offset + 64] = b"\xff" * 64
    p.write_bytes(bytes(data))
    chunks = list(read_chunks(p, ReadSpec(keep=("k",)), render))
    assert sum(len(c) for c in chunks) == 200
    assert [c.first_row for c in chunks] == [0, 100, 150]  # two good groups, the bad one, the last
    bad = chunks[1]
    assert len(bad) == 50 and len(set(bad.errors)) == 1 and bad.ids.null_count == 50
    assert bad.errors[0].startswith(f"{p}: row group 2 of 4 is unreadable from its row 0 on")
    assert bad.ids.type == pa.int64() and bad.keep["k"].type == pa.string()
    assert sum(e is None for c in chunks for e in c.errors) == 150


def test_directories_and_globs_skip_policyscans_own_outputs(tmp_path):
    arch = tmp_path / "arch"
    (arch / "scores").mkdir(parents=True)
    for name in ("a.jsonl", "scores/a.scores.parquet", "scores/a.scores.jsonl", "scores/a.scores.jsonl.meta.json",
                 "scores/a.scores.parquet.errors.jsonl", "scores/a.scores.jsonl.gz", "b.errors.jsonl", "c.json"):
        (arch / name).write_text("")
    assert [p.name for p in expand_inputs([str(arch)])] == ["a.jsonl"]  # a directory: no .json either
    assert [p.name for p in expand_inputs([str(arch / "**" / "*")])] == ["a.jsonl", "c.json"]
    assert [p.name for p in expand_inputs([str(arch / "scores" / "a.scores.parquet")])] == ["a.scores.parquet"]
    with pytest.raises(InputError, match="own outputs are never inputs"):
        expand_inputs([str(arch / "scores" / "*")])


def test_link_loops_and_aliases_give_each_real_file_once(tmp_path):
    d = tmp_path / "d"
    (d / "sub").mkdir(parents=True)
    (d / "a.jsonl").write_text("")
    (d / "sub" / "b.jsonl").write_text("")
    os.symlink(d, d / "sub" / "up")  # two loops: glob's ** alone would never end
    os.symlink(d / "sub", d / "sub" / "here")
    os.symlink(d / "a.jsonl", d / "alias.jsonl")
    notes: list[str] = []
    found = expand_inputs([str(d / "**" / "*.jsonl")], notes.append)
    assert sorted(p.name for p in found) == ["a.jsonl", "b.jsonl"]
    assert notes == [f"policyscan: {d / 'alias.jsonl'} is the same file as {d / 'a.jsonl'}; it is read once"]
    assert sorted(p.name for p in expand_inputs([str(d)], notes.append)) == ["a.jsonl", "b.jsonl"]


def test_the_same_file_twice_is_read_once_and_said_so(tmp_path, capsys):
    p = tmp_path / "a.jsonl"
    p.write_text("")
    assert expand_inputs([str(p), str(tmp_path / "." / "a.jsonl"), str(tmp_path)]) == [p]
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and all(line.endswith(f"is the same file as {p}; it is read once") for line in err)


def test_a_linked_folder_is_read_once_under_its_own_name(tmp_path):
    (tmp_path / "arch" / "real").mkdir(parents=True)
    (tmp_path / "arch" / "real" / "x.jsonl").write_text("")
    os.symlink(tmp_path / "arch" / "real", tmp_path / "arch" / "a_link")  # sorts first, is walked last
    notes: list[str] = []
    assert expand_inputs([str(tmp_path / "arch")], notes.append) == [tmp_path / "arch" / "real" / "x.jsonl"]
    assert notes == []


def test_a_byte_order_mark_at_the_start_is_not_part_of_the_first_row(tmp_path):
    """Windows tools write UTF-8 with a BOM: the first line is an object like the others, read whole and in the
    workers' byte ranges alike; a BOM elsewhere is content and stays."""
    from policyscan.engine.inputs.jsonl import read_jsonl_range
    p = tmp_path / "a.jsonl"
    body = b'{"id": "a", "text": "first"}\n{"id": "b", "text": "\xef\xbb\xbfsecond"}\n'
    p.write_bytes(b"\xef\xbb\xbf" + body)
    got = rows(p)
    assert [(r[1], r[2], r[3]) for r in got] == [("a", "first", None), ("b", "\ufeffsecond", None)]
    ranged = list(read_jsonl_range(p, ReadSpec(), render, 0, p.stat().st_size, 1, 0, ("text", False)))
    assert [t for c in ranged for t in c.texts] == ["first", "\ufeffsecond"]


def test_a_struct_that_names_a_field_twice_is_its_files_error(tmp_path):
    """A messages struct <role, content, content>, at any depth of a column read (the conversation, the id, a kept
    column): which field holds the data cannot be told, so the file is refused, naming the column and the field."""
    role, c1, c2 = pa.array(["user"]), pa.array(["a violation"]), pa.array(["hello"])
    twice = pa.StructArray.from_arrays([role, c1, c2], fields=[pa.field("role", pa.string()),
                                                               pa.field("content", pa.string()),
                                                               pa.field("content", pa.string())])
    messages = pa.ListArray.from_arrays(pa.array([0, 1], pa.int32()), twice)
    p = tmp_path / "m.parquet"
    pq.write_table(pa.table({"id": ["a"], "messages": messages}), p)
    with pytest.raises(InputError, match=r"column 'messages' holds a struct that names the field 'content' twice"):
        rows(p)
    pq.write_table(pa.table({"id": ["a"], "text": ["hi"], "meta": pa.array([[{"k": 1}]]).cast(
        pa.list_(pa.struct([("k", pa.int64())]))), "bad": messages}), p)
    assert rows(p, ReadSpec(keep=("meta",)))[0][3] is None  # a column not read is not looked at
    with pytest.raises(InputError, match=r"column 'bad' holds a struct"):
        rows(p, ReadSpec(keep=("bad",)))
