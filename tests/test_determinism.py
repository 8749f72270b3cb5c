"""Same input, same settings, same bits: f and p from `policyscan score` run in separate processes (a fresh CUDA
context each) are equal bit for bit at 64 and 256 policies of mixed ranks, in bf16 and FP8; the Engine's f does
not depend on --batch-tokens or on CUDA graphs; `policyscan verify` of a 64-policy output exits 0. The same
three-process check runs on the CPU path."""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hf_fixtures import hf_config, make_model, write_policies

from policyscan.engine.outputs.sinks import read_metadata

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
TEMPLATE = {"prefix": "Policy: the assistant must not break rule 7.\nConversation:\n", "suffix": "\nVerdict:"}
DEEP = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=8, num_attention_heads=8,
            num_key_value_heads=4, head_dim=32, vocab_size=1024, max_position_embeddings=4096)


def bundle(root: Path, n_policies: int, **model_kw) -> tuple[Path, Path]:
    """A random llama checkpoint with the sample model's tokenizer, and n policies (mixed ranks, templated)."""
    model = root / "model"
    make_model(model, "llama", **model_kw)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SAMPLE / "model" / name, model / name)
    write_policies(root / "policies", hf_config("llama", **model_kw), n_policies, seed=n_policies,
                   template=TEMPLATE)
    return model, root / "policies"


def texts(n: int, repeats: int = 23) -> pa.Table:
    """n conversations as plain text, lengths from a few tokens to over a thousand (several batch sizes)."""
    rows = pq.read_table(SAMPLE / "conversations.parquet").to_pylist()
    out = []
    for i in range(n):
        turns = [f"{m['role']}: {m['content']}" for m in rows[i % len(rows)]["messages"]]
        out.append("\n".join(turns * (1 + (i * 7) % repeats)))
    return pa.table({"id": [f"c{i}" for i in range(n)], "text": out})


def score_in_processes(tmp: Path, model: Path, policies: Path, src: Path, args: list[str], n: int = 3,
                       together: bool = False) -> list[pa.Table]:
    """n separate `policyscan score` processes, one after another, or (together) all at once: then they also
    contend with each other for the cores, which must not move a bit either."""
    cmds = []
    for i in range(n):
        out = tmp / f"run{i}.parquet"
        cmds.append([sys.executable, "-c", "from policyscan.cli.main import main; main()", "score", str(src),
                     "-o", str(out), "--model", str(model), "--policies", str(policies), "--raw", "--no-progress",
                     *args])
    if together:
        procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for c in cmds]
        for proc in procs:
            log, _ = proc.communicate(timeout=900)
            assert proc.returncode == 0, log
    else:
        for cmd in cmds:
            res = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
            assert res.returncode == 0, res.stdout + res.stderr
    return [pq.read_table(tmp / f"run{i}.parquet") for i in range(n)]


def assert_same_bits(tables: list[pa.Table]) -> None:
    cols = [c for c in tables[0].column_names if c.startswith(("f_", "p_"))]
    assert cols
    first = {c: tables[0].column(c).to_numpy() for c in cols}
    assert all(np.isfinite(v).all() for v in first.values())
    for t in tables[1:]:
        for c in cols:
            v = t.column(c).to_numpy()
            differ = int((v.view(np.uint64 if v.dtype.itemsize == 8 else np.uint32)
                          != first[c].view(np.uint64 if v.dtype.itemsize == 8 else np.uint32)).sum())
            assert differ == 0, f"{c}: {differ} of {v.size} rows differ between processes"


@pytest.mark.gpu
@pytest.mark.parametrize("n_policies,rows", [(64, 24), (256, 8)])
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_scores_are_bitwise_equal_across_processes(tmp_path, n_policies, rows, precision):
    model, policies = bundle(tmp_path, n_policies, **DEEP)
    src = tmp_path / "logs.parquet"
    pq.write_table(texts(rows), src)
    tables = score_in_processes(tmp_path, model, policies, src, ["--precision", precision])
    assert_same_bits(tables)
    assert len([c for c in tables[0].column_names if c.startswith("p_")]) == n_policies
    if n_policies == 64 and precision == "fp8":
        res = subprocess.run([sys.executable, "-c", "from policyscan.cli.main import main; main()", "verify",
                              str(tmp_path / "run0.parquet"), "--sample", str(rows)],
                             capture_output=True, text=True, timeout=900)
        assert res.returncode == 0, res.stdout + res.stderr


def assert_f_at_every_budget(model: Path, policies: Path, precision: str, budgets: tuple[int, ...],
                             max_length: int, table: pa.Table) -> list[int]:
    """The Engine's f at every budget, with and without CUDA graphs, bitwise the f at the last budget with graphs;
    returns the conversations' token counts."""
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    pols = load_policies([policies])
    convs, results = None, {}
    for budget in budgets:
        for graphs in (True, False):
            eng = Engine(model, pols, EngineSettings("cuda", precision, batch_tokens=budget, max_length=max_length,
                                                     cuda_graphs=graphs))
            if convs is None:
                convs = [np.asarray(x) for x in eng.encoder.encode_batch(table.column("text").to_pylist())]
            results[(budget, graphs)] = eng.score_conversations(convs)[0]
            del eng
    base = results[(budgets[-1], True)]
    assert np.isfinite(base).all()
    for key, f in results.items():
        assert np.array_equal(f.view(np.uint32), base.view(np.uint32)), \
            f"{key}: {int((f != base).sum())} of {f.size} differ from budget {budgets[-1]} with graphs"
    return [len(c) for c in convs]


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_f_does_not_depend_on_batch_tokens_or_graphs(tmp_path, precision):
    """64 policies, through the Engine: every budget, with and without CUDA graphs, bitwise the same f."""
    model, policies = bundle(tmp_path, 64, **DEEP)
    assert_f_at_every_budget(model, policies, precision, (2048, 3000, 16384, 65536), 2048, texts(24))


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_f_of_long_conversations_does_not_depend_on_batch_tokens_or_graphs(tmp_path, precision):
    """128-wide heads, conversations from a few tokens to past 2048 keys with the policy's cached prefix, where the
    attention takes its long tile (tuning.attention_long_tile): every budget, with and without CUDA graphs, bitwise
    the same f."""
    from policyscan.kernels.tuning import attention_long_tile

    wide = dict(DEEP, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=128,
                max_position_embeddings=8192)
    assert attention_long_tile(2, 128, False) is not None
    model, policies = bundle(tmp_path, 8, **wide)
    lengths = assert_f_at_every_budget(model, policies, precision, (4096, 9000, 65536), 4096, texts(12, repeats=80))
    assert max(lengths) > 2100 and min(lengths) < 1000, sorted(lengths)


@pytest.fixture(scope="module")
def cpu_bundle(tmp_path_factory) -> tuple[Path, Path, Path]:
    """One small model, 12 policies and a 10-row log for both CPU precisions (written once)."""
    root = tmp_path_factory.mktemp("cpu_bundle")
    model, policies = bundle(root, 12, **dict(DEEP, num_hidden_layers=3, intermediate_size=352, hidden_size=128))
    src = root / "logs.parquet"
    pq.write_table(texts(10, repeats=4), src)
    return model, policies, src


@pytest.mark.slow  # three real processes, each importing torch and loading the model: ~6 s on an idle 2-core machine
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cpu_scores_are_bitwise_equal_across_processes(tmp_path, cpu_bundle, precision):
    model, policies, src = cpu_bundle
    tables = score_in_processes(tmp_path, model, policies, src, ["--device", "cpu", "--precision", precision,
                                                                  "--batch-tokens", "3000"], together=True)
    assert_same_bits(tables)
    assert read_metadata(tmp_path / "run0.parquet")["accounting"]["rows_scored"] == 10
