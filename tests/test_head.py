"""The two-token head kernel (kernels/head.py): against fp64, within what its fp32 torch twin is off, and every
row independent of the batch around it (on the GPU when there is one, else in Triton's interpreter)."""
from __future__ import annotations

import pytest
import torch

from policyscan.kernels import reference
from policyscan.kernels.head import head

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("B,H", [(1, 7), (5, 96), (33, 130), (9, 3072)])
def test_head_matches_fp64_and_ignores_the_batch(B, H):
    seed = int(torch.randint(0, 2**31, ()))
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    h, w = torch.randn(B, H, generator=g) * 3, torch.rand(H, generator=g) + 0.5
    rows = torch.randn(4, H, generator=g)
    ad = torch.randint(-1, 4, (B,), generator=g, dtype=torch.int32)
    ad[0] = 2
    f = head(h.to(DEV), w.to(DEV), 1e-5, rows.to(DEV), ad.to(DEV)).cpu()
    exact = reference.head(h.double(), w.double(), 1e-5, rows.double(), ad)
    twin = reference.head(h, w, 1e-5, rows, ad).double()
    terms = (reference.rmsnorm(h.double(), w.double(), 1e-5) * rows.double()[ad.long().clamp(min=0)]).abs().sum(-1)
    bound = 4 * (twin - exact).abs().max() + 4 * torch.finfo(torch.float32).eps * terms.max()
    assert (f.double() - exact).abs().max() <= bound
    assert (f[ad < 0] == 0).all()
    alone = torch.stack([head(h[i:i + 1].to(DEV), w.to(DEV), 1e-5, rows.to(DEV), ad[i:i + 1].to(DEV)).cpu()[0]
                         for i in range(B)])
    assert torch.equal(alone, f)
