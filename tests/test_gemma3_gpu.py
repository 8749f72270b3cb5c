"""gemma3 on the GPU kernels (bf16 and FP8 W8A8) against transformers + PEFT (fp64 the reference), within bounds
of the form test_gpu_engine.py sets the other architectures; batch invariance; CUDA graph replay bitwise the eager
forward. Three fixtures: the odd-sized one of the CPU tests, its logits soft-capped with tied embeddings, and one
with the real models' attention (head_dim 256, 4 heads on 1 KV head)."""
from __future__ import annotations

import pytest
import torch
from hf_fixtures import hf_scores, make_bundle
from test_gpu_engine import LABELS, decoder

from policyscan.engine.run.batch import pack

pytestmark = pytest.mark.gpu
VARIANTS = {"odd": {}, "capped": dict(tie=True, final_logit_softcapping=3.0),
            "heads256": dict(head_dim=256, num_attention_heads=4, num_key_value_heads=1, hidden_size=128,
                             sliding_window=33)}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_engine_matches_reference_and_hf(tmp_path, variant):
    from policyscan.kernels import reference, triton_ops

    dirs = make_bundle(tmp_path, "gemma3", **VARIANTS[variant])
    g = torch.Generator().manual_seed(7)
    lengths = [1, 5, 17, 3, 40, 9, 2, 70, 33]
    seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]
    ads = sorted([i % 3 for i in range(len(seqs))])
    batch = pack(seqs, ads)
    model = tmp_path / "model"
    exact = hf_scores(model, dirs, seqs, ads, LABELS, torch.float64)
    hf16 = hf_scores(model, dirs, seqs, ads, LABELS, torch.bfloat16)
    cpu = decoder(model, dirs, reference, "cpu", torch.float32).forward(batch).double()
    cpu16 = decoder(model, dirs, reference, "cpu", torch.bfloat16).forward(batch).double()
    bf16 = decoder(model, dirs, triton_ops, "cuda", torch.bfloat16).forward(batch.to("cuda")).double().cpu()
    fp8 = decoder(model, dirs, triton_ops, "cuda", torch.bfloat16, True, True).forward(batch.to("cuda")).double().cpu()
    twin = decoder(model, dirs, reference, "cpu", torch.bfloat16, True, True).forward(batch).double()
    p = torch.sigmoid
    for name, (a, b) in {"cpu fp32 vs HF fp64": (cpu, exact), "gpu bf16 vs HF fp64": (bf16, exact),
                         "HF bf16 vs HF fp64": (hf16, exact), "cpu bf16 vs HF fp64": (cpu16, exact),
                         "gpu bf16 vs cpu bf16": (bf16, cpu16), "gpu fp8 vs HF fp64": (fp8, exact),
                         "cpu W8A8 twin vs HF fp64": (twin, exact)}.items():
        d = (p(a) - p(b)).abs()
        print(f"gemma3 {variant} {name}: max |df| {(a - b).abs().max():.2e}, max |dp| {d.max():.2e}")
    assert (cpu - exact).abs().max() <= 1e-4
    # Twice the error of the worse of two other bf16 implementations of the model: HF's, and the kernels' CPU twin
    # (the same rounding points, another summation order). Against HF's alone, as for the other architectures: on
    # these fixtures the ratio of the CPU twin's bf16 error to HF's swings past 2 with the model's seed.
    assert (bf16 - exact).abs().max() <= 2 * max((hf16 - exact).abs().max(), (cpu16 - exact).abs().max())
    assert (fp8 - exact).abs().max() <= 2 * (twin - exact).abs().max() + (hf16 - exact).abs().max()


@pytest.mark.parametrize("variant", ["odd", "heads256"])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_batch_invariance(tmp_path, variant, fp8):
    """Each sequence alone, in a batch, and in a batch of 1100+ rows (the FP8 Gluon GEMM for qkv, o and down; the
    GELU gate_up stays on the Triton kernel): bitwise the same f, with and without a prefix cache."""
    from policyscan.kernels import triton_ops

    dirs = make_bundle(tmp_path, "gemma3", **VARIANTS[variant])
    dec = decoder(tmp_path / "model", dirs, triton_ops, "cuda", torch.bfloat16, fp8, fp8)
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, 211, (int(n),), generator=g).tolist() for n in torch.randint(1, 90, (12,), generator=g)]
    ads = sorted(torch.randint(0, 3, (12,), generator=g).tolist())
    filler = [torch.randint(0, 211, (100,), generator=g).tolist() for _ in range(11)]
    with torch.inference_mode():
        for prefix in (None, dec.prefill_prefixes([[1, 2, 3], [], list(range(4, 20))])):
            alone = torch.stack([dec.forward(pack([s], [a]).to("cuda"), prefix)[0] for s, a in zip(seqs, ads)])
            together = dec.forward(pack(seqs, ads).to("cuda"), prefix)
            big = dec.forward(pack(seqs + filler, ads + [2] * len(filler)).to("cuda"), prefix)[:len(seqs)]
            assert torch.equal(together, alone) and torch.equal(big, alone)


@pytest.mark.parametrize("fp8", [False, True])
def test_cuda_graph_replay_is_bitwise_eager(tmp_path, fp8):
    """Batches replayed from CUDA graphs (padded to their buckets, graphs reused across batches) give bitwise the
    eager forward's f, with and without a prefix cache, both layer types' rope tables held by each graph; a batch
    above max_tokens runs eagerly and grows the tables the earlier graphs still read."""
    from policyscan.engine.run.graphs import GraphedForward
    from policyscan.kernels import triton_ops

    dirs = make_bundle(tmp_path, "gemma3")
    dec = decoder(tmp_path / "model", dirs, triton_ops, "cuda", torch.bfloat16, fp8, fp8)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    with torch.inference_mode():
        for prefix in (None, dec.prefill_prefixes([[1, 2, 3], [], list(range(4, 40))])):
            run = GraphedForward(dec, prefix, max_tokens=512, min_tokens=64)
            for lengths in ([1], [5, 17, 3], [40, 9, 2, 70, 33], [1] * 30, [100, 100, 100, 100, 100, 11],
                            [3, 4], [300, 300], [4200], [5, 17, 3], [40, 9, 2, 70, 33]):
                seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]
                batch = pack(seqs, sorted(torch.randint(0, 3, (len(seqs),), generator=g).tolist()))
                eager = dec.forward(batch.to("cuda"), prefix)
                assert torch.equal(run(batch), eager), (lengths, prefix is not None)
            assert len(run.graphs) >= 4  # buckets were captured and reused, the longer batches ran eagerly
