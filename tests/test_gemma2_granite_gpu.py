"""gemma2 and granite on the GPU kernels (bf16 and FP8 W8A8): batch invariance (their bounds against HF are
test_gpu_engine.py's, where both are among the architectures)."""
from __future__ import annotations

import pytest
import torch
from hf_fixtures import make_bundle
from test_gpu_engine import decoder

from policyscan.engine.run.batch import pack

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("arch", ["gemma2", "granite"])
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_batch_invariance(tmp_path, arch, fp8):
    """Each sequence alone, in a batch, and in a batch of 1100+ rows (the FP8 GEMM's Gluon kernel for granite;
    gemma2's GELU gate_up stays on the Triton kernel): bitwise the same f, with and without a prefix cache."""
    from policyscan.kernels import triton_ops

    dirs = make_bundle(tmp_path, arch)
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
