"""The row maxima the gate/up GEMM and the attention leave for the next FP8 prologue (row_amax / x_amax).

They replace the quantizer's own statistics sweep, so they must be exact: the max over a row's partials is
the max of |y| as stored, bit for bit, and a prologue given them writes bitwise what it writes without."""
from __future__ import annotations

import pytest
import torch
from kernel_cases import CPU, CPU_ATTN_SHAPES, GPU, GPU_ATTN_SHAPES, adapters_for, gemm_case, gen, lora_stack, packed

from policyscan.kernels import reference

triton = pytest.importorskip("triton")
from policyscan.kernels.attention import varlen_attention  # noqa: E402
from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402
from policyscan.kernels.prologue import prologue  # noqa: E402


def row_max(y: torch.Tensor) -> torch.Tensor:
    return y.float().abs().amax(1)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("silu", [False, True])
def test_lora_gemm_row_amax(device, silu):
    """Every kernel and tile shape: the Triton kernel (small M, and every shape on the CPU) and on the GPU the
    warp-specialized one (M > 1024); odd N leaves a tile's columns past the end, which must not count."""
    g = gen()
    shapes = [(37, 46, 70, 1, 3), (130, 98, 200, 16, 9)] if device == "cpu" else \
        [(300, 3074, 3072, 16, 8), (4099, 16384, 3072, 16, 8), (2500, 1030, 512, 7, 5)]
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for M, N, K, r, n_ad in shapes:
        for fp8 in (False, True):
            case, _ = gemm_case(M, N, K, r, n_ad, dtype, fp8, False, False, g, device)
            plain = lora_gemm(**case, out_dtype=dtype, silu_out=silu)
            y, parts = lora_gemm(**case, out_dtype=dtype, silu_out=silu, row_amax=True)
            assert torch.equal(y, plain), "row_amax changed the output"
            assert parts.dtype == torch.float32 and parts.shape[1] == M
            assert torch.equal(parts.amax(0), row_max(y)), f"M={M} N={N} fp8={fp8} silu={silu}"
            ref_y, ref_parts = reference.lora_gemm(**case, out_dtype=dtype, silu_out=silu, row_amax=True)
            assert torch.equal(ref_parts.amax(0), row_max(ref_y))
            if not silu:  # times the next RMSNorm's weight (the o and down projections)
                w = (1 + 0.3 * torch.randn(N, generator=g)).to(dtype).to(device)
                y, parts = lora_gemm(**case, out_dtype=dtype, row_amax=True, amax_weight=w)
                assert torch.equal(parts.amax(0), row_max(y.float() * w.float())), f"M={M} N={N} weighted"


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("last_only", [False, True])
def test_attention_row_amax(device, last_only):
    """Per key/value head group, over groups of 1 to 7 query heads, with an empty sequence (a zero row)."""
    g = gen()
    lengths = [1, 7, 33, 0, 64, 20, 3] if device == "cpu" else [1, 700, 257, 0, 64, 1500, 3]
    shapes = CPU_ATTN_SHAPES if device == "cpu" else GPU_ATTN_SHAPES
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    for shape in shapes:
        qkv = torch.randn(sum(lengths), (shape.heads + 2 * shape.kv_heads) * shape.head_dim,
                          generator=g).to(dtype).to(device)
        args = (qkv, packed(lengths, device), shape, shape.head_dim ** -0.5, None, last_only)
        out, parts = varlen_attention(*args, row_amax=True)
        assert torch.equal(out, varlen_attention(*args)), "row_amax changed the output"
        assert parts.shape == (shape.kv_heads, out.shape[0])
        assert torch.equal(parts.amax(0), row_max(out)), f"{shape} last_only={last_only}"
        group_max = out.float().abs().unflatten(1, (shape.kv_heads, -1)).amax(-1).T  # each group's own rows
        assert torch.equal(parts, group_max), f"{shape} last_only={last_only}: a partial holds another group"


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("norm", [False, True])
def test_prologue_with_x_amax_is_bitwise_the_same(device, norm):
    """Given the partials (of |x * w| with a norm), the quantizing prologue writes the same h8, scales and
    shrink as with its own sweep (the kernel on the GPU, where the FP8 quantizer is checked; the twin
    everywhere)."""
    g = gen()
    for M, K, r, n_ad, P in [(37, 96, 5, 3, 3), (300, 3072, 16, 8, 24), (1000, 8192, 16, 64, 64)]:
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
        x[3] = 0  # an all-zero row: scale 1
        w = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype).to(device) if norm else None
        u = x.float() * w.float() if norm else x.float()
        parts = u.abs().reshape(M, P, K // P).amax(-1).T.contiguous()
        ad = adapters_for(M, n_ad, g, device)
        A, _ = lora_stack(n_ad, r, 1, K, dtype, g, device)
        fns = [reference.prologue] + ([prologue] if device == "cuda" else [])
        for fn in fns:
            own = fn(x, w, 1e-5, A, ad, True)
            given = fn(x, w, 1e-5, A, ad, True, x_amax=parts)
            for a, b, what in zip(own, given, ("h8", "scale", "s")):
                assert torch.equal(a.float(), b.float()), f"{fn.__module__} M={M} K={K} norm={norm}: {what}"
    with pytest.raises(ValueError, match="x_amax"):
        prologue(x, None, 1e-5, A, ad, True, x_amax=parts[:, :-1])
