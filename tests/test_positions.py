"""A prompt never runs past the model's positions: with --max-length above max_position_embeddings (the sample
model has 1024, the default --max-length 2048), prompts are cut at the model's positions, marked and counted as
cut, the run says so when it cut one, and the metadata records the length used; the same conversation cut at --max-length 1024
gives bitwise the same scores."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from cli_cases import SAMPLE, run

from policyscan.engine.model.config import ModelConfig, read_config
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings, OptionError

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
    assert "prompts capped at 1024 tokens, the model's max_position_embeddings, below --max-length 2048" in res.output
    got = pq.read_table(tmp_path / "default.parquet").to_pylist()
    assert [r["truncated"] for r in got] == [True, False], got
    meta = read_metadata(tmp_path / "default.parquet")
    assert meta["max_length"] == 1024 and meta["settings"]["max_length"] == 2048
    assert meta["accounting"]["truncated_prompts"] == 2  # the long conversation, once for each of the two policies
    # --max-length 1024 itself: the same prompts, so bitwise the same scores, and nothing to say
    res = run("score", src, "-o", tmp_path / "given.parquet", *CPU, "--max-length", "1024")
    assert "max_position_embeddings" not in res.output
    assert pq.read_table(tmp_path / "given.parquet").equals(pq.read_table(tmp_path / "default.parquet"))
    # a batch need only hold the prompt the model allows, whatever --max-length asks
    run("score", src, "-o", tmp_path / "small_batch.parquet", *CPU, "--batch-tokens", "1024")
    assert pq.read_table(tmp_path / "small_batch.parquet").equals(pq.read_table(tmp_path / "default.parquet"))
    res = run("score", src, "-o", tmp_path / "x.parquet", *CPU, "--batch-tokens", "1000", ok=(2,))
    assert ("--batch-tokens (1000) must be at least the 1024 tokens a prompt may take (the model's "
            "max_position_embeddings, below --max-length 2048)") in res.output, res.output
    with pytest.raises(OptionError, match=r"--batch-tokens \(1000\) must be at least the 1024 tokens"):
        Engine(SAMPLE / "model", load_policies([SAMPLE / "policies"]), EngineSettings("cpu", batch_tokens=1000))
    # no prompt cut: nothing said, and the metadata still records the length prompts could take
    pq.write_table(pa.Table.from_pylist(rows[1:]), src)
    res = run("score", src, "-o", tmp_path / "short.parquet", *CPU)
    assert "truncated prompts 0" in res.output and "max_position_embeddings" not in res.output
    assert read_metadata(tmp_path / "short.parquet")["max_length"] == 1024


def test_a_template_longer_than_the_models_positions_is_refused_saying_so(tmp_path):
    """--max-length above the model's positions cannot make room for a template that does not fit in them."""
    import shutil

    policy = tmp_path / "pii"
    shutil.copytree(SAMPLE / "policies" / "pii", policy)
    meta = json.loads((policy / "policy.json").read_text())
    meta["template"]["prefix"] = "Policy: no personal data. " * 200 + "\nConversation:\n"
    (policy / "policy.json").write_text(json.dumps(meta))
    res = run("score", SAMPLE / "conversations.parquet", "-o", tmp_path / "o.parquet", "--policies", policy,
              "--device", "cpu", "--max-length", "4096", "--batch-tokens", "8192", ok=(1,))
    assert "leaving none of the 1024 a prompt may take (--max-length, or the model's max_position_embeddings" \
        in res.output, res.output


def test_verify_reproduces_a_capped_run_and_refuses_one_written_before_the_cap(tmp_path):
    """An output's metadata records the length its prompts took: verify repeats the capped run bit for bit, and an
    output from before the cap (no such record, --max-length above the model's positions) cannot be repeated."""
    out = tmp_path / "o.parquet"
    src = tmp_path / "logs.parquet"
    pq.write_table(pq.read_table(SAMPLE / "conversations.parquet").slice(0, 3), src)
    run("score", src, "-o", out, "--device", "cpu", "--threads", "1", "--no-progress")
    res = run("verify", out)
    assert "all reproduced bit for bit" in res.output, res.output
    meta = read_metadata(out)
    del meta["max_length"]
    pq.write_table(pq.read_table(out).replace_schema_metadata({b"policyscan": json.dumps(meta).encode()}), out)
    res = run("verify", out, ok=(1,))
    assert "its prompts could take 2048 tokens, this policyscan cuts them at 1024" in res.output, res.output
    assert "the run cannot be repeated" in res.output
