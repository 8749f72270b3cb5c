"""The GPU engine (Triton kernels, bf16 and FP8 W8A8) against the CPU reference and transformers + PEFT."""
from __future__ import annotations

import pytest
import torch
from hf_fixtures import WIDE_SPECS, hf_scores, make_bundle

from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack

pytestmark = pytest.mark.gpu
LABELS = [(3, 7), (11, 5), (20, 21)]


def decoder(model_dir, dirs, ops, device, dtype, fp8=False, w8a8=False):
    dec = load_decoder(Checkpoint.open(model_dir), ops, Precision(dtype, fp8, w8a8), device)
    attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
    return dec


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "llama-wide", "gemma2", "granite"])
def test_gpu_engine_matches_reference_and_hf(tmp_path, arch):
    """llama-wide: WIDE_SPECS' adapters, whose stacks pass rank 64 (qkv 128)."""
    from policyscan.kernels import reference, triton_ops

    arch, _, wide = arch.partition("-")
    dirs = make_bundle(tmp_path, arch, specs=WIDE_SPECS if wide else None)
    g = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 3, 40, 9, 2, 70, 33]
    seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]
    ads = sorted([i % 3 for i in range(len(seqs))])
    batch = pack(seqs, ads)
    exact = hf_scores(tmp_path / "model", dirs, seqs, ads, LABELS, torch.float64)
    hf16 = hf_scores(tmp_path / "model", dirs, seqs, ads, LABELS, torch.bfloat16)
    cpu = decoder(tmp_path / "model", dirs, reference, "cpu", torch.float32).forward(batch).double()
    bf16 = decoder(tmp_path / "model", dirs, triton_ops, "cuda", torch.bfloat16).forward(batch.to("cuda"))
    bf16 = bf16.double().cpu()
    fp8 = decoder(tmp_path / "model", dirs, triton_ops, "cuda", torch.bfloat16, True, True).forward(
        batch.to("cuda")).double().cpu()
    cpu_fp8 = decoder(tmp_path / "model", dirs, reference, "cpu", torch.float32, fp8=True).forward(batch).double()
    # the W8A8 twin: the same quantization of weights and activations, torch ops on the CPU, bf16
    twin = decoder(tmp_path / "model", dirs, reference, "cpu", torch.bfloat16, True, True).forward(batch).double()
    p = torch.sigmoid
    rows = {"cpu fp32 vs HF fp64": (cpu, exact), "gpu bf16 vs HF fp64": (bf16, exact),
            "HF bf16 vs HF fp64": (hf16, exact), "gpu fp8 vs HF fp64": (fp8, exact),
            "gpu fp8 vs cpu fp8-weights": (fp8, cpu_fp8), "cpu W8A8 twin vs HF fp64": (twin, exact)}
    for name, (a, b) in rows.items():
        d = (p(a) - p(b)).abs()
        print(f"{arch} {name}: max |dp| {d.max():.2e}, mean {d.mean():.2e}")
    assert (cpu - exact).abs().max() <= 1e-4
    assert (bf16 - exact).abs().max() <= 2 * (hf16 - exact).abs().max()
    # FP8 activations add their own rounding: the GPU may be off by what its same-precision twin is off
    twin_err = (twin - exact).abs().max()
    assert (fp8 - exact).abs().max() <= 2 * twin_err + (hf16 - exact).abs().max()


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replay_is_bitwise_eager(tmp_path, fp8):
    """Batches replayed from CUDA graphs (padded to their buckets, graphs reused across batches) give
    bitwise the eager forward's f, with and without a prefix cache; a batch above max_tokens runs eagerly."""
    from policyscan.engine.run.graphs import GraphedForward
    from policyscan.kernels import triton_ops

    dirs = make_bundle(tmp_path, "qwen3")
    dec = decoder(tmp_path / "model", dirs, triton_ops, "cuda", torch.bfloat16, fp8, fp8)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    with torch.inference_mode():
        for prefix in (None, dec.prefill_prefixes([[1, 2, 3], [], list(range(4, 40))])):
            run = GraphedForward(dec, prefix, max_tokens=512, min_tokens=64)
            for lengths in ([1], [5, 17, 3], [40, 9, 2, 70, 33], [1] * 30, [100, 100, 100, 100, 100, 11],
                            [3, 4], [300, 300]):
                seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]
                batch = pack(seqs, sorted(torch.randint(0, 3, (len(seqs),), generator=g).tolist()))
                eager = dec.forward(batch.to("cuda"), prefix)
                assert torch.equal(run(batch), eager), (lengths, prefix is not None)
            assert len(run.graphs) >= 4  # buckets were captured and reused, the 600-token batch ran eagerly
