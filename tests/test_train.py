"""policyscan train on the sample model: a rule the base does not know learned from labeled rows, the adapter
scoring as the trainer computed it (score's engine and transformers + PEFT from the files), bitwise the same run to
run in separate processes, Ctrl-C leaving the folder as it was, and bad input refused or listed."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from cli_cases import SAMPLE, run
from hf_fixtures import hf_scores

from policyscan.calibration.metrics import roc_auc
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.outputs.sinks import ErrorWriter
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.training.data import read_examples
from policyscan.training.loop import LoopSettings
from policyscan.training.run import TrainJob, train_policy

pytest.importorskip("peft")

LABELED = SAMPLE / "labeled.parquet"
FAST = ["--label-column", "pii", "--max-length", "128", "--batch-tokens", "2048", "--lr", "5e-3", "--no-progress"]


def fresh_policy(root: Path, name: str = "pii", **changes) -> Path:
    """The sample's pii policy.json alone (no adapter, no calibration): a policy to train from scratch."""
    meta = json.loads((SAMPLE / "policies" / "pii" / "policy.json").read_text())
    meta.pop("calibration")
    meta.update(changes)
    folder = root / name
    folder.mkdir(parents=True)
    (folder / "policy.json").write_text(json.dumps(meta, indent=2))
    return folder


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "policyscan.cli.main", *map(str, args)], capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    root = tmp_path_factory.mktemp("train")
    policy = fresh_policy(root)
    res = cli("train", LABELED, "--policy", policy, "--epochs", "3", *FAST)
    assert res.returncode == 0, res.stderr
    return policy, res.stdout


def test_a_rule_the_base_does_not_know_is_learned(trained):
    policy, out = trained
    rec = json.loads((policy / "policy.json").read_text())
    training = rec["training"]
    print(out)
    assert training["untrained"]["holdout_roc_auc"] < 0.75  # the base model alone: about chance
    assert training["holdout_after_calibration"]["roc_auc"] >= 0.95
    assert training["rows"]["read"] == 400 and training["rows"]["errors"] == 0
    assert training["lora"] == {"rank": 16, "alpha": 32.0, "targets": ["q_proj", "k_proj", "v_proj", "o_proj",
                                                                       "gate_proj", "up_proj", "down_proj"],
                                "rslora": False}
    assert training["files"][0]["sha256"] and training["base_model_sha256"]
    assert training["deterministic_algorithms"] == "on" and training["precision"] == "fp32"
    assert rec["calibration"]["fp8_check"]["rows"] == training["rows"]["holdout"]["violation"] + \
        training["rows"]["holdout"]["compliant"]
    assert {"adapter_config.json", "adapter_model.safetensors", "policy.json"} <= {p.name for p in policy.iterdir()}
    assert not list(policy.parent.glob(".pii.train-*"))  # the staging folder is gone


def test_score_and_peft_give_the_trainers_f(trained, tmp_path):
    """The parity train checks (score's engine against the trainer), and transformers + PEFT loading the written
    adapter from its files, on the held-out rows' prompts."""
    policy_dir, _ = trained
    assert json.loads((policy_dir / "policy.json").read_text())["training"]["parity"]["max_abs_diff"] <= 1e-5
    engine = Engine(SAMPLE / "model", [load_policy(policy_dir)], EngineSettings("cpu", "fp32", max_length=128))
    errors = ErrorWriter(tmp_path / "e.jsonl")
    ex = read_examples(engine, engine.policies[0], [LABELED], ReadSpec(), "pii", 0.2, errors)
    rows = ex.holdout[:12]
    ours = engine.score([list(e.ids) for e in rows], [0] * len(rows)).astype(np.float64)
    c, v = engine.encoder.verdict_ids(engine.policies[0])
    ref = hf_scores(SAMPLE / "model", [policy_dir], [list(e.ids) for e in rows], [0] * len(rows), [(c, v)],
                    torch.float32).numpy()
    assert np.abs(ours - ref).max() <= 1e-5


def test_score_reads_the_trained_policy(trained, tmp_path):
    policy_dir, _ = trained
    out = tmp_path / "scores.parquet"
    run("score", LABELED, "-o", out, "--policies", policy_dir, "--raw", "--keep", "pii", "--max-length", "128",
        "--device", "cpu")
    t = pq.read_table(out)
    p, y = np.array(t["p_pii"].to_pylist()), np.array(t["pii"].to_pylist())
    assert roc_auc(p, y.astype(bool)) >= 0.95


def _labeled_with_bad_rows(path: Path) -> Path:
    """The sample's labeled rows, with a row whose label is no label, one whose messages are null, and one whose
    label is a label string."""
    t = pq.read_table(LABELED).slice(0, 160)
    rows = t.to_pylist()
    rows[3]["pii"] = 7
    rows[5]["messages"] = None
    rows[8]["pii"] = None
    out = pa.Table.from_pylist(rows, schema=pa.schema([(f.name, pa.int64() if f.name in ("pii", "investment_advice")
                                                        else f.type) for f in t.schema]))
    pq.write_table(out, path)
    return path


def test_the_same_command_twice_gives_the_same_adapter_bits_and_bad_rows_are_listed(tmp_path):
    data = _labeled_with_bad_rows(tmp_path / "labeled.parquet")
    bits = []
    for i in range(2):
        policy = fresh_policy(tmp_path / f"run{i}")
        res = cli("train", data, "--policy", policy, "--epochs", "1", "--holdout", "0.3", *FAST)
        assert res.returncode == 0, res.stderr
        bits.append((policy / "adapter_model.safetensors").read_bytes())
        errors = [json.loads(line) for line in
                  (policy.parent / "pii.train-errors.jsonl").read_text().splitlines()]
        assert [(e["row"], e["file"]) for e in errors] == [(3, str(data)), (5, str(data)), (8, str(data))]
        assert "label 7 is not 0/1" in errors[0]["reason"] and "label None" in errors[2]["reason"]
        rows = json.loads((policy / "policy.json").read_text())["training"]["rows"]
        assert rows["read"] == 160 and rows["errors"] == 3
        assert sum(rows["train"].values()) + sum(rows["holdout"].values()) == 157
    assert bits[0] == bits[1]
    cfg = json.loads((tmp_path / "run0" / "pii" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 16 and cfg["base_model_name_or_path"] is None


def test_ctrl_c_mid_epoch_leaves_the_bundle_as_it_was(tmp_path):
    policy = tmp_path / "pii"
    shutil.copytree(SAMPLE / "policies" / "pii", policy)
    before = {p.name: p.read_bytes() for p in policy.iterdir()}
    steps = []

    def interrupt(what, value):
        if what == "step":
            steps.append(value)
            if len(steps) == 2:
                raise KeyboardInterrupt

    job = TrainJob(SAMPLE / "model", policy, (LABELED,), ReadSpec(), tmp_path / "errors.jsonl",
                   loop=LoopSettings(epochs=2, batch_tokens=2048), label_column="pii", max_length=128, force=True)
    with pytest.raises(KeyboardInterrupt):
        train_policy(job, interrupt, say=lambda _: None)
    assert {p.name: p.read_bytes() for p in policy.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pii"]  # no staging folder, no errors file


def test_the_models_positions_bound_training_prompts_as_they_bound_score(tmp_path):
    """A model of 128 positions under --max-length 2048: the trainer cuts prompts where score does (the parity check
    would fail otherwise), and the record gives the length used, as score's metadata does."""
    model = tmp_path / "model"
    shutil.copytree(SAMPLE / "model", model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 128}))
    policy = fresh_policy(tmp_path)
    job = TrainJob(model, policy, (LABELED,), ReadSpec(), tmp_path / "errors.jsonl",
                   loop=LoopSettings(epochs=1, batch_tokens=2048), label_column="pii", max_length=2048)
    result = train_policy(job, say=lambda _: None)
    assert result.record["max_length"] == 128
    assert json.loads((policy / "policy.json").read_text())["training"]["max_length"] == 128


@pytest.mark.parametrize("change, args, code, message", [
    (None, ["--holdout", "0.99"], 2, "--holdout"),
    (None, ["--targets", "q,lm_head"], 2, "'lm_head'] is not among q, k, v"),
    (None, ["--rank", "0"], 2, "--rank"),
    ({"labels": {"compliant": " Violation here", "violation": " Violation"}}, [], 1, "start with the same token"),
    ({"template": {"prefix": "alpha beta gamma " * 60, "suffix": "\nVerdict:"}}, [], 1, "leaving none of the 128 a prompt may take"),
])
def test_a_policy_or_option_that_cannot_train_is_refused_before_any_training(tmp_path, change, args, code, message):
    policy = fresh_policy(tmp_path, **(change or {}))
    res = cli("train", LABELED, "--policy", policy, *FAST, *args, timeout=120)
    assert res.returncode == code and message in res.stderr, res.stderr
    assert sorted(p.name for p in policy.iterdir()) == ["policy.json"]


def test_too_few_rows_of_a_class_names_the_counts(tmp_path):
    rows = pq.read_table(LABELED).to_pylist()
    few = [r for r in rows if r["pii"] == 0][:60] + [r for r in rows if r["pii"] == 1][:4]
    data = tmp_path / "few.parquet"
    pq.write_table(pa.Table.from_pylist(few), data)
    policy = fresh_policy(tmp_path)
    res = cli("train", data, "--policy", policy, *FAST, timeout=120)
    assert res.returncode == 2 and "violation and" in res.stderr and "needs at least" in res.stderr, res.stderr


def test_an_adapter_already_there_needs_force(tmp_path):
    policy = tmp_path / "pii"
    shutil.copytree(SAMPLE / "policies" / "pii", policy)
    res = cli("train", LABELED, "--policy", policy, *FAST, timeout=120)
    assert res.returncode == 2 and "already holds an adapter" in res.stderr and "--force" in res.stderr


def test_a_review_queue_gives_only_the_rows_that_name_the_policy(tmp_path):
    from policyscan.engine.text.prompts import PolicyPrompts

    rows = pq.read_table(LABELED).slice(0, 12).to_pylist()
    queue = [{"id": r["id"], "messages": r["messages"], "policy": "pii" if i % 3 else "investment_advice",
              "label": r["pii"]} for i, r in enumerate(rows)]
    data = tmp_path / "queue.parquet"
    pq.write_table(pa.Table.from_pylist(queue), data)
    policy = load_policy(fresh_policy(tmp_path))
    prompts = PolicyPrompts.for_policies(SAMPLE / "model", [policy], 128)
    ex = read_examples(prompts, policy, [data], ReadSpec(), None, 0.2, ErrorWriter(tmp_path / "e.jsonl"))
    assert ex.counts()["other_policies"] == 4 and len(ex.train) + len(ex.holdout) == 8
    assert {e.id for e in ex.train + ex.holdout} == {q["id"] for q in queue if q["policy"] == "pii"}


def test_fp8_training_checks_score_against_the_fp32_computation(tmp_path):
    """--precision fp8 on the CPU: the base fake-quantized as FP8 scoring runs it, and score's W8A8 twin within
    twice the trainer's own bf16 distance from the fp32 computation."""
    data = tmp_path / "sub.parquet"
    pq.write_table(pq.read_table(LABELED).slice(0, 200), data)
    policy = fresh_policy(tmp_path)
    res = cli("train", data, "--policy", policy, "--epochs", "1", "--holdout", "0.3", "--precision", "fp8", *FAST)
    assert res.returncode == 0, res.stderr
    rec = json.loads((policy / "policy.json").read_text())["training"]
    assert rec["precision"] == "fp8" and 0 < rec["parity"]["score_vs_fp32"] <= rec["parity"]["bound"]
    assert rec["parity"]["bound"] == pytest.approx(2 * rec["parity"]["train16_vs_fp32"] + 1e-6)
