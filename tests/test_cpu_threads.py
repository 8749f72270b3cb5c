"""The CPU path's threads (cpu_rows.set_threads, EngineSettings.threads) change no bit of f, its whole-tensor
elementwise twins give each row what a 16-row block alone gives it, and `--precision fp8` runs the W8A8 twin."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hf_fixtures import make_bundle

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.kernels import cpu_rows, reference

SAMPLE = Path(__file__).resolve().parents[1] / "policyscan" / "sample_data"


@pytest.fixture(autouse=True)
def restore_threads():
    before = torch.get_num_threads()
    yield
    cpu_rows.set_threads(1)
    torch.set_num_threads(before)


def blocks16(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over 16-row blocks, zero-padded: what reference.row_blocks did before the twins ran on whole tensors."""
    pad = (-x.shape[0]) % 16
    xp = torch.cat([x, x.new_zeros((pad,) + x.shape[1:])])
    return torch.cat([fn(xp[i:i + 16]) for i in range(0, xp.shape[0], 16)])[:x.shape[0]]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_whole_tensor_twins_equal_16_row_blocks(threads, dtype):
    torch.manual_seed(0)
    torch.set_num_threads(threads)
    w = torch.randn(352).to(dtype)
    ops = {"rmsnorm": lambda t: reference.rmsnorm(t[:, :352].to(dtype), w, 1e-5),
           "silu": lambda t: F.silu(t[:, 0::2]) * t[:, 1::2], "softmax": lambda t: torch.softmax(t, -1)}
    x = torch.randn(700, 2048) * 4  # 700 x 2048 passes torch's 32768-element grain: several threads split it
    for name, fn in ops.items():
        for m in (1, 17, 333, 700):
            assert torch.equal(fn(x[:m]), blocks16(fn, x[:m])), (name, m)


@pytest.mark.parametrize("k,n", [(1000, 20), (2048, 48), (2048, 512), (33, 7)])
def test_rows_matmul_rows_independent_of_rows_and_threads(k, n):
    """(1000, 20) and (2048, 512): shapes where MKL on 2 threads gave a row other bits with other rows beside it."""
    torch.manual_seed(1)
    x, w = torch.randn(600, k), torch.randn(n, k)
    cpu_rows.set_threads(1)
    full = reference.rows_matmul(x, w)
    for threads in (1, 2, 3):
        cpu_rows.set_threads(threads)
        assert torch.equal(reference.rows_matmul(x, w), full), threads
        for m in (1, 16, 100, 333):
            assert torch.equal(reference.rows_matmul(x[:m], w), full[:m]), (threads, m)


def test_f_bitwise_the_same_for_any_thread_count(tmp_path):
    dirs = make_bundle(tmp_path, "llama")
    dec = load_decoder(Checkpoint.open(tmp_path / "model"), reference, Precision(torch.float32), "cpu")
    attach_policies(dec, [load_policy(d) for d in dirs], [(3, 7), (11, 5), (20, 21)])
    g = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, 211, (int(n),), generator=g).tolist() for n in (5, 300, 40, 129, 1, 77)]
    batch = pack(seqs, [0, 1, 2, 0, 1, 2])
    out = {}
    for threads in (1, 2, 3):
        cpu_rows.set_threads(threads)
        with torch.inference_mode():
            out[threads] = dec.forward(batch)
    assert torch.equal(out[1], out[2]) and torch.equal(out[1], out[3])


def test_threads_setting_is_validated():
    with pytest.raises(PolicyscanError, match="--threads"):
        EngineSettings(threads=0)


def test_fp8_on_the_cpu_runs_the_w8a8_twin():
    policies = [load_policy(SAMPLE / "policies" / p) for p in ("pii", "investment_advice")]
    texts = ["user: my neighbour's phone number is 555 0199, call him", "user: should I buy index funds?",
             "assistant: I cannot share that.", "user: what stocks will double next year?"]
    f = {}
    for precision in ("fp32", "fp8"):
        eng = Engine(SAMPLE / "model", policies, EngineSettings(device="cpu", precision=precision, threads=2))
        f[precision] = eng.score_conversations([np.asarray(eng.encoder.encode(t)) for t in texts])[0]
        assert eng.describe()["precision"] == precision
    assert type(eng.decoder.layers[0].qkv).__name__ == "Fp8LoraLinear" and eng.decoder.dtype == torch.bfloat16
    diff = np.abs(f["fp8"] - f["fp32"])
    assert np.isfinite(f["fp8"]).all() and diff.max() > 0
    assert diff.max() < 0.1 * np.abs(f["fp32"]).max() + 0.05, (diff, f["fp32"])  # e4m3 (2^-4) noise, no more


def test_threads_option_gives_the_same_table_and_is_left_out_of_the_run_key(tmp_path):
    """`--threads 1` and `--threads 2` write the same scores; an archive scored with one is up to date for the
    other (threads change no bit of f)."""
    import pyarrow.parquet as pq
    from click.testing import CliRunner

    from policyscan.cli.main import cli

    sample = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
    src = tmp_path / "in" / "logs.parquet"
    src.parent.mkdir()
    pq.write_table(pq.read_table(sample / "conversations.parquet").slice(0, 12), src)
    outs = []
    for n in (1, 2):
        res = CliRunner().invoke(cli, ["score", str(src), "-o", str(tmp_path / f"o{n}.parquet"), "--raw",
                                       "--no-progress", "--threads", str(n)])
        assert res.exit_code == 0, res.output
        outs.append(pq.read_table(tmp_path / f"o{n}.parquet"))
    assert outs[0].equals(outs[1])
    for n in (1, 2):
        res = CliRunner().invoke(cli, ["score", str(src), "-o", str(tmp_path / "dir") + "/", "--no-progress",
                                       "--threads", str(n)])
        assert res.exit_code == 0, res.output
    assert "up to date" in res.output
