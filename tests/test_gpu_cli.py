"""`policyscan score` on a GPU as a user runs it: the default is the fused FP8 engine with CUDA graphs."""
from __future__ import annotations

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_cli import SAMPLE, run

from policyscan.engine.outputs.sinks import read_metadata

pytestmark = pytest.mark.gpu
SRC = SAMPLE / "conversations.parquet"
F_COLS = ["f_investment_advice", "f_pii"]


def score(out, *args) -> np.ndarray:
    run("score", SRC, "-o", out, "--raw", "--no-progress", *args)
    meta = read_metadata(out)
    assert meta["accounting"]["rows_in"] == meta["accounting"]["rows_scored"] == 200
    assert meta["accounting"]["balanced"]
    t = pq.read_table(out)
    return np.stack([t.column(c).to_numpy() for c in F_COLS], axis=1).astype(np.float64)


def test_default_on_a_gpu_is_fp8_with_graphs_and_matches_eager(tmp_path):
    f = score(tmp_path / "g.parquet")
    meta = read_metadata(tmp_path / "g.parquet")
    assert meta["device"].startswith("cuda") and meta["precision"] == "fp8" and meta["settings"]["cuda_graphs"]
    assert meta["gpu"] and meta["cuda_version"] and meta["triton_version"]
    assert np.isfinite(f).all()
    # the sample's short prompts all run through CUDA graphs; eager gives bitwise the same table
    score(tmp_path / "e.parquet", "--no-cuda-graphs")
    assert pq.read_table(tmp_path / "g.parquet").equals(pq.read_table(tmp_path / "e.parquet"))


def test_gpu_bf16_within_the_cpu_bf16_twins_error(tmp_path):
    """The whole CLI path on the GPU in bf16 is off the CPU's fp32 f by at most twice what the CPU's own bf16
    run (the torch twins of the kernels) is off, plus a bf16 ulp of f for the final rounding."""
    exact = score(tmp_path / "c32.parquet", "--device", "cpu", "--precision", "fp32")
    twin = score(tmp_path / "c16.parquet", "--device", "cpu", "--precision", "bf16")
    gpu = score(tmp_path / "g16.parquet", "--precision", "bf16")
    bound = 2 * np.abs(twin - exact).max() + 2 ** -7 * np.abs(exact).max()
    assert np.abs(gpu - exact).max() <= bound, (np.abs(gpu - exact).max(), bound)
