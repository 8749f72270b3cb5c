"""A prompt never runs past the model's positions: with --max-length above max_position_embeddings (the sample
model has 1024, the default --max-length 2048), prompts are cut at the model's positions, marked and counted as
cut, the run says so, and the metadata records the length used; the same conversation cut at --max-length 1024
gives bitwise the same scores."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
from cli_cases import SAMPLE, run

from policyscan.engine.model.config import ModelConfig, read_config
from policyscan.engine.outputs.sinks import read_metadata

CPU = ["--device", "cpu", "--threads", "1", "--raw", "--mark-truncated", "--batch-tokens", "4096"]


def test_prompts_past_the_models_positions_are_cut_there_and_said(tmp_path):
    positions = ModelConfig.from_dict(read_config(SAMPLE / "model")).max_position
    assert positions == 1024
    long = " ".join(f"word{i} about my savings" for i in range(700))  # well past 1024 tokens
    rows = [{"id": "long", "messages": [{"role": "user", "content": long}]},
            {"id": "short", "messages": [{"role": "user", "content": "how do I reset my password?"}]}]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(rows), src)
    res = run("score", src, "-o", tmp_path / "default.parquet", *CPU)
    assert "prompts were cut at 1024 tokens, the model's max_position_embeddings, not --max-length 2048" in res.output
    got = pq.read_table(tmp_path / "default.parquet").to_pylist()
    assert [r["truncated"] for r in got] == [True, False], got
    meta = read_metadata(tmp_path / "default.parquet")
    assert meta["max_length"] == 1024 and meta["settings"]["max_length"] == 2048
    assert meta["accounting"]["truncated_prompts"] == 2  # the long conversation, once for each of the two policies
    # --max-length 1024 itself: the same prompts, so bitwise the same scores, and nothing to say
    res = run("score", src, "-o", tmp_path / "given.parquet", *CPU, "--max-length", "1024")
    assert "max_position_embeddings" not in res.output
    same = pq.read_table(tmp_path / "given.parquet")
    assert same.equals(pq.read_table(tmp_path / "default.parquet"))
