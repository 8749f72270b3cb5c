"""Ids that name no row, and JSON that says two things under one key: each is its row's error (or its file's, where
the whole file is so), named, and nothing is written as a guess. The readers are tested directly (no model)."""
from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from test_sources import rows

from policyscan.engine.errors import CheckpointError, InputError, PolicyError
from policyscan.engine.inputs.sources import ReadSpec
from policyscan.engine.json_schema import read_json
from policyscan.engine.tensor_header import open_header


def test_a_jsonl_id_must_be_a_string_or_an_integer(tmp_path):
    p = tmp_path / "a.jsonl"
    ids = ["a", 7, None, 1.5, 2e3, True, [1], {"x": 1}, -3]
    p.write_text("".join(json.dumps({"id": i, "text": f"row {n}"}) + "\n" for n, i in enumerate(ids)))
    got = rows(p)
    assert [(r[0], r[1]) for r in got if r[3] is None] == [(1, "a"), (2, "7"), (9, "-3")]
    errors = {r[0]: (r[1], r[3]) for r in got if r[3] is not None}
    assert errors[3] == (None, "null id (field 'id'); give every row an id, or name another field with --id-column")
    assert errors[4][0] == "1.5" and "the id (field 'id') has a fraction or an exponent" in errors[4][1]
    assert errors[5][0] == "2000.0"
    assert errors[6] == ("true", "the id (field 'id') is true; ids must be strings or integers")
    assert "is a list" in errors[7][1] and "is an object" in errors[8][1]
    assert all(r[2] is None for r in got if r[3] is not None)  # no text: none of them is scored


def test_the_id_column_named_by_id_column_is_checked_the_same(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"uid": null, "id": "x", "text": "t"}\n{"uid": "u2", "text": "t"}\n')
    got = rows(p, ReadSpec(id_column="uid"))
    assert "null id (field 'uid')" in got[0][3] and got[1][1] == "u2" and got[1][3] is None


def test_a_null_parquet_id_is_its_rows_error(tmp_path):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ["a", None, "c", None], "text": ["w", "x", "y", None]}), p)
    got = rows(p)
    assert [(r[1], r[3]) for r in got if r[3] is None] == [("a", None), ("c", None)]
    assert "null id (column 'id')" in got[1][3] and got[1][2] is None
    assert got[3][3] == "null conversation"  # the row's own error comes first


@pytest.mark.parametrize("ids", [pa.array([1, 2], pa.int64()), pa.array([3, 4], pa.uint16()),
                                 pa.array([10**30, 7], pa.decimal128(38, 0)),
                                 pa.array(["a", "b"]).dictionary_encode(), pa.array(["a", "b"], pa.large_string())])
def test_parquet_ids_of_strings_or_integers_are_read(tmp_path, ids):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ids, "text": ["x", "y"]}), p)
    assert [r[3] for r in rows(p)] == [None, None]


@pytest.mark.parametrize("ids", [pa.array([1.5, 2.0]), pa.array([True, False]), pa.array([{"a": 1}, {"a": 2}]),
                                 pa.array([1, 2], pa.decimal128(10, 2)),
                                 pa.array([b"a", b"b"], pa.binary())])
def test_a_parquet_id_column_of_another_type_is_the_files_error(tmp_path, ids):
    p = tmp_path / "a.parquet"
    pq.write_table(pa.table({"id": ids, "text": ["x", "y"]}), p)
    kind = re.escape(str(ids.type))
    with pytest.raises(InputError, match=rf"a\.parquet: id column 'id' has type {kind}; ids must be strings or "
                                         "integers: name another column with --id-column"):
        rows(p)


def test_a_jsonl_line_that_names_a_key_twice_is_its_rows_error(tmp_path):
    p = tmp_path / "a.jsonl"
    p.write_text('{"id": "a", "text": "compliant", "text": "violating"}\n'
                 '{"id": "b", "messages": [{"role": "user", "role": "system", "content": "hi"}]}\n'
                 '{"id": "c", "text": "fine", "meta": {"k": 1, "k": 2}}\n'
                 '{"id": "d", "text": "fine"}\n')
    got = rows(p)
    assert [r[1] for r in got] == ["a.jsonl:1", "a.jsonl:2", "a.jsonl:3", "d"]
    for r, key in zip(got[:3], ("text", "role", "k")):
        assert r[3] == (f"ambiguous JSON: the key {key!r} appears twice in one object, so which value is meant "
                        "cannot be told")
    assert got[3][2] == "fine" and got[3][3] is None


def test_a_config_or_policy_file_that_names_a_key_twice_is_refused(tmp_path):
    p = tmp_path / "policy.json"
    p.write_text('{"labels": ["Yes", "No"], "threshold": 0.5, "threshold": 0.9}')
    with pytest.raises(PolicyError, match=r"policy\.json: not valid JSON \(the key 'threshold' appears twice"):
        read_json(p, PolicyError)
    p.write_bytes(b'\xef\xbb\xbf{"a": 1}')  # a BOM reads as json.loads reads bytes
    assert read_json(p, PolicyError) == {"a": 1}


def test_a_safetensors_header_that_names_a_tensor_twice_is_refused(tmp_path):
    p = tmp_path / "adapter_model.safetensors"
    entry = '{"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}'
    header = f'{{"w": {entry}, "w": {entry}}}'.encode()
    p.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 4)
    with pytest.raises(CheckpointError, match=r"adapter_model\.safetensors: its header is ambiguous: the key 'w' "
                                              "appears twice"):
        open_header(p, CheckpointError)
