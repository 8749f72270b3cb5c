"""Random kernel inputs with the shapes that break kernels: odd sizes, rank 1, skewed adapters, rows with none.

Tolerance rule: a kernel may be off from the fp64 reference by at most twice what the same-precision torch
computation (the reference twin) is off, plus a couple of ulps of the output dtype for the final rounding."""
from __future__ import annotations

import pytest
import torch

from policyscan.kernels import reference

CPU = pytest.param("cpu", id="interp")
GPU = pytest.param("cuda", id="gpu", marks=pytest.mark.gpu)
# query heads per key/value head: 3 (W1, and a group that is not a power of two), 1, 4 (W4), 7 (Qwen2-0.5B)
CPU_ATTN_SHAPES = [reference.AttnShape(6, 2, 20), reference.AttnShape(3, 3, 20), reference.AttnShape(8, 2, 16)]
GPU_ATTN_SHAPES = [reference.AttnShape(24, 8, 128), reference.AttnShape(32, 8, 64), reference.AttnShape(14, 2, 64)]


def gen(seed=None) -> torch.Generator:
    """A generator seeded fresh each time (fresh random inputs), or with `seed`; the seed is printed (pytest
    shows it with a failure), so gen(seed) replays the draw."""
    seed = seed if seed is not None else torch.seed() % 2**31
    print(f"torch generator seed {seed}")
    return torch.Generator().manual_seed(seed)


def adapters_for(rows: int, n: int, g: torch.Generator, device) -> torch.Tensor:
    """Sorted adapter ids with skewed popularity (Zipf-like) and a run of -1 (sequences with no adapter); from 64
    adapters on, a random half of them absent, as when a batch holds a few policies of a large stack (gaps of
    ids between the adapters a tile holds)."""
    weights = 1.0 / torch.arange(1, n + 1, dtype=torch.float64) ** 1.2
    if n >= 64:
        weights[torch.randperm(n, generator=g)[: n // 2]] = 0.0
    ids = torch.multinomial(weights, rows, replacement=True, generator=g)
    ids[torch.rand(rows, generator=g) < 0.1] = -1
    return ids.sort().values.to(torch.int32).to(device)


def lora_stack(n: int, r: int, out: int, k: int, dtype, g, device):
    A = (torch.randn(n, r, k, generator=g) / k ** 0.5).to(dtype).to(device)
    B = (torch.randn(n, out, r, generator=g) / r ** 0.5).to(dtype).to(device)
    return A, B


def tol(ref_same: torch.Tensor, ref64: torch.Tensor, dtype: torch.dtype, factor: float = 2.0) -> float:
    eps = torch.finfo(dtype).eps
    return factor * (ref_same.double() - ref64).abs().max().item() + 2 * eps * ref64.abs().max().item()


def check(out: torch.Tensor, ref_same: torch.Tensor, ref64: torch.Tensor, what: str, factor: float = 2.0) -> None:
    """factor: how far the kernel may be from fp64, in units of the twin's own error. 2 for outputs rounded to
    16 bits; fp32 sums in another order (tensor-core accumulation) need 4 (seen: 2.08x on a K=3072 shrink)."""
    assert torch.isfinite(out.double()).all(), f"{what}: non-finite values (unwritten output?)"
    err = (out.double() - ref64).abs().max().item()
    bound = tol(ref_same, ref64, out.dtype if out.dtype.is_floating_point else torch.float32, factor)
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e}"


def gemm_case(M, N, K, r, n_ad, dtype, fp8, residual, bias, g, device):
    """Inputs for lora_gemm; x/W already e4m3 when fp8 (quantized by the twin's own quantizer)."""
    x = torch.randn(M, K, generator=g).to(dtype).to(device)
    W = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype).to(device)
    xs = ws = None
    if fp8:
        x, xs = reference.quantize_rows(x)
        Wq, ws = reference.quantize_rows(W)
        W = Wq
    ad = adapters_for(M, n_ad, g, device)
    A, B = lora_stack(n_ad, r, N, K, dtype, g, device)
    s = (torch.randn(M, r, generator=g) * 0.5).to(device)
    res = torch.randn(M, N, generator=g).to(dtype).to(device) if residual else None
    b = torch.randn(N, generator=g).to(device) if bias else None
    return dict(x=x, x_scale=xs, W=W, w_scale=ws, s=s, B=B, token_adapter=ad, bias=b, residual=res), A


def packed(lengths: list[int], device) -> torch.Tensor:
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths), 0)
    return cu.to(device)


def up64(d: dict) -> dict:
    """The same call with every float input in fp64 (fp8 values are exact in fp64)."""
    return {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in d.items()}


def shrink_in_k_order(h: torch.Tensor, A: torch.Tensor, token_adapter: torch.Tensor, bk: int = 128) -> torch.Tensor:
    """The LoRA shrink in fp32 summed the way a tensor-core kernel sums: bk-wide dot products added in K order.
    reference.lora_shrink sums narrow outputs (r < 16) in one tree reduction over K, far more accurate than
    any blocked kernel, so on few outputs its error alone makes a bound that a correct kernel can miss
    (on the GPU, 5 rows at r = 1, K = 3072 came out 4.5x the twin's error)."""
    M, K = h.shape
    pad = (-K) % bk
    s = torch.zeros(M, A.shape[1], dtype=torch.float32, device=h.device)
    for a in torch.unique(token_adapter).tolist():
        if a < 0:
            continue
        rows = (token_adapter == a).nonzero().squeeze(1)
        x = torch.nn.functional.pad(h[rows].float(), (0, pad)).unflatten(1, (-1, bk))
        w = torch.nn.functional.pad(A[a].float(), (0, pad)).unflatten(1, (-1, bk))
        acc = torch.zeros(len(rows), A.shape[1], dtype=torch.float32, device=h.device)
        for c in range(x.shape[1]):
            acc += x[:, c] @ w[:, c].T
        s[rows] = acc
    return s


def further_from(ref64: torch.Tensor, *twins: torch.Tensor) -> torch.Tensor:
    """The twin with the largest error against fp64: a bound built from it covers either summation order."""
    return max(twins, key=lambda t: (t.double() - ref64).abs().max().item())
