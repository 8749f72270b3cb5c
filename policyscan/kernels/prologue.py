"""Prologue of a linear layer: RMSNorm (or nothing), per-token FP8 quantization and the LoRA shrink.

Semantics: reference.prologue. At 16 bits h = rmsnorm(x, w) (or x), rounded to x.dtype, and s = h @
A[token_adapter].T in fp32 (zeros for adapter -1). Quantizing, u = x * w (or x), exact in fp32:
(h8, scale) = quantize_rows(u), the row scale written is scale * rstd and s = rstd * x @ A.T with A
carrying w, rstd = 1 / sqrt(mean(x^2) + eps): rmsnorm(x) * w = rstd * u, so the norm folds into the GEMM's row
scale and into A (layers.Fp8LoraLinear).

The shrink reads 16-bit activations, never the FP8 ones (docs/design.md). One program owns BM rows and sweeps K
in chunks. The FP8 scale needs amax |u| before the first write; the kernels that write every projection's
input (attention, and the GEMM epilogues, times the next norm's weight) leave partial row maxima of what they
stored (x_amax), whose max is that amax exactly, so a quantizing prologue sweeps its input once and sums the
norm's squares on the way (bench/sweep.py; faster per layer and end to end, docs/performance.md). Without
x_amax (the first layer's input, the embeddings) a first sweep finds the amax; at 16 bits a first sweep finds
the sum of squares, which must come before the normed h is written.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyscan.kernels.fast_math import rcp
from policyscan.kernels.tuning import PROLOGUE_BP, prologue_tiles

try:
    from policyscan.kernels import gluon_prologue
except (ImportError, AttributeError):  # another Triton: the Triton kernel below takes every call
    gluon_prologue = None


@triton.jit
def _xu_chunk(x_ptr, nw_ptr, rm, m_ok, rk, K, stride_xm, NORM: tl.constexpr):
    """One chunk of x and of u = x * w (or x), fp32: exact, since x and w are 16-bit."""
    k_ok = rk < K
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                other=0.0).to(tl.float32)
    u = x
    if NORM:
        u = x * tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)[None, :]
    return x, u


@triton.jit
def _out_chunk(x_ptr, nw_ptr, h_ptr, rm, m_ok, rk, K, stride_xm, stride_hm, scale, inv, rstd, ss,
               NORM: tl.constexpr, QUANT: tl.constexpr, FAST: tl.constexpr):
    """Writes one chunk of the output (e4m3 u / scale, or the 16-bit normed row) and returns the chunk the
    shrink reads, at 16 bits, with the norm's running sum of squares (quantizing with a norm). FAST: u times
    the row's inv = rcp(scale), the bits of '/' in one multiply (fast_math.py)."""
    mask = m_ok[:, None] & (rk[None, :] < K)
    out_ptrs = h_ptr + rm[:, None] * stride_hm + rk[None, :]
    if QUANT:
        # The shrink reads h = x as loaded (with a norm, A carries its weight): a loaded operand goes to the MMA
        # from the pipeline's shared memory, where the normed u at 16 bits went through registers and a layout
        # conversion, and the single-adapter sweep wins now (config below). Without a norm, converting
        # a fp32 copy back had slowed o's prologue by a third (docs/performance.md).
        h = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
        u = h.to(tl.float32)
        if NORM:
            ss += tl.sum(u * u, axis=1)
            u = u * tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)[None, :]
        if FAST:  # e4m3's conversion on the GPU saturates at +-448 (cvt.rn.satfinite): no clamp
            q = u * inv[:, None]
        else:
            q = tl.clamp(u / scale[:, None], -448.0, 448.0)
        tl.store(out_ptrs, q.to(h_ptr.dtype.element_ty), mask=mask)
    else:
        h = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
        if NORM:
            w = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
            h = (h.to(tl.float32) * rstd[:, None] * w[None, :]).to(x_ptr.dtype.element_ty)
        tl.store(out_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)
    return h, ss


@triton.jit
def _shrink_chunk(h, sacc, a_ptr, a_id, ad, rr, rk, R, K, stride_an, stride_ar, PREC: tl.constexpr):
    """sacc += h @ A[a_id].T on one chunk, for the rows of adapter a_id. Masked before the add, which keeps the
    sum in fp32 adds: with the mask after the loop the compiler chained the dots in the tensor core, and the
    shrink drifted from fp64 by 2.8e-5 against a bound of 9.0e-6."""
    at = tl.load(a_ptr + a_id * stride_an + rr[:, None] * stride_ar + rk[None, :],
                 mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
    part = tl.dot(h.to(at.dtype), tl.trans(at), input_precision=PREC)
    return sacc + tl.where((ad == a_id)[:, None], part, 0.0)


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@triton.jit(do_not_specialize=["M", "stride_ap"])
def _prologue_kernel(
    x_ptr, nw_ptr, a_ptr, ad_ptr, h_ptr, hs_ptr, s_ptr, amax_ptr,
    M, K, R, P, eps,
    stride_xm, stride_hm, stride_an, stride_ar, stride_sm, stride_ap,
    NORM: tl.constexpr, QUANT: tl.constexpr, HAS_LORA: tl.constexpr, HAS_AMAX: tl.constexpr, ONE_AD: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
    FAST: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = rm < M
    nk = tl.cdiv(K, BK)
    rstd = tl.full((BM,), 1.0, dtype=tl.float32)
    scale = tl.full((BM,), 1.0, dtype=tl.float32)
    inv = scale
    if QUANT:
        # The FP8 scale is amax |u|, u = x * w (or x): from the writer's partial row maxima (exact) or a sweep
        mx = tl.zeros((BM,), dtype=tl.float32)
        if HAS_AMAX:
            for p0 in range(0, P, BP):
                rp = p0 + tl.arange(0, BP)
                part = tl.load(amax_ptr + rp[:, None] * stride_ap + rm[None, :],
                               mask=(rp[:, None] < P) & m_ok[None, :], other=0.0)
                mx = tl.maximum(mx, tl.max(part, axis=0))
        else:
            for k in range(0, nk):
                rk = k * BK + tl.arange(0, BK)
                x, u = _xu_chunk(x_ptr, nw_ptr, rm, m_ok, rk, K, stride_xm, NORM)
                mx = tl.maximum(mx, tl.max(tl.abs(u), axis=1))
        # 448: the largest finite e4m3 (reference.FP8_MAX); at least 2^-126, so that rcp(scale) is finite
        scale = tl.where(mx > 0, tl.maximum(mx / 448.0, 1.1754943508222875e-38), 1.0)
        if FAST:
            inv = rcp(scale)
    elif NORM:  # 16-bit output: the norm comes first, so its sum of squares needs a sweep of its own
        ss = tl.zeros((BM,), dtype=tl.float32)
        for k in range(0, nk):
            rk = k * BK + tl.arange(0, BK)
            x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K),
                        other=0.0).to(tl.float32)
            ss += tl.sum(x * x, axis=1)
        rstd = 1.0 / tl.sqrt(ss / K + eps)
    rr = tl.arange(0, BR)
    sacc = tl.zeros((BM, BR), dtype=tl.float32)
    ss = tl.zeros((BM,), dtype=tl.float32)
    lo = 0
    hi = -1
    ad = tl.full((BM,), -1, dtype=tl.int32)
    if HAS_LORA:
        ad = tl.load(ad_ptr + rm, mask=m_ok, other=-1)
        lo = tl.min(tl.where(ad >= 0, ad, 2147483647), axis=0)
        hi = tl.max(ad, axis=0)
    if ONE_AD and lo == hi:
        # One adapter in the block, the usual case (rows are sorted by adapter): no loop over adapters inside
        # the sweep, so A's loads are software-pipelined with x's (see the launcher for where it pays).
        for k in range(0, nk):
            rk = k * BK + tl.arange(0, BK)
            h, ss = _out_chunk(x_ptr, nw_ptr, h_ptr, rm, m_ok, rk, K, stride_xm, stride_hm, scale, inv, rstd, ss,
                               NORM, QUANT, FAST)
            sacc = _shrink_chunk(h, sacc, a_ptr, lo, ad, rr, rk, R, K, stride_an, stride_ar, PREC)
    else:  # several adapters in the block, none, or no LoRA
        for k in range(0, nk):
            rk = k * BK + tl.arange(0, BK)
            h, ss = _out_chunk(x_ptr, nw_ptr, h_ptr, rm, m_ok, rk, K, stride_xm, stride_hm, scale, inv, rstd, ss,
                               NORM, QUANT, FAST)
            if HAS_LORA:  # the adapters present only, in a loop never pipelined (as lora_gemm's expand)
                a_id = lo
                while a_id <= hi:
                    sacc = _shrink_chunk(h, sacc, a_ptr, a_id, ad, rr, rk, R, K, stride_an, stride_ar, PREC)
                    a_id = tl.min(tl.where(ad > a_id, ad, 2147483647), axis=0)
    if QUANT:
        if NORM:  # rmsnorm(x) * w = rstd * u: rstd goes into the row scale and the shrink
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            sacc = sacc * rstd[:, None]
        tl.store(hs_ptr + rm, scale * rstd, mask=m_ok)
    if HAS_LORA:
        tl.store(s_ptr + rm[:, None] * stride_sm + rr[None, :], sacc, mask=m_ok[:, None] & (rr[None, :] < R))


def prologue(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
             A: torch.Tensor | None, token_adapter: torch.Tensor, quant: bool,
             out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
             config: dict | None = None, x_amax: torch.Tensor | None = None, tma: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launcher; same semantics as reference.prologue. x [M, K]; `out` (h, h_scale, s) is written in place
    when given; `config` (BM, BK, num_warps, num_stages, ONE_AD) overrides tuning.prologue_tiles (bench/sweep.py);
    x_amax [P, M] fp32, partial row maxima of |x * norm weight| (or |x|) from the kernel that wrote x
    (lora_gemm's and varlen_attention's row_amax), spares a quantizing prologue its first sweep. tma: a
    quantizing call with x_amax runs gluon_prologue's TMA-fed kernel where it can (`usable`), which is faster
    alone but not always end to end at the power cap (its docstring: the caller decides)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be 2-D with a contiguous last dimension, got {tuple(x.shape)}")
    M, K = x.shape
    if norm_weight is not None and norm_weight.shape != (K,):
        raise ValueError(f"norm weight {tuple(norm_weight.shape)} does not fit width {K}")
    R = 0
    if A is not None:
        R = A.shape[1]
        if A.shape[2] != K or A.stride(2) != 1 or A.dtype != x.dtype:
            raise ValueError(f"A {tuple(A.shape)} {A.dtype} does not fit x [{M}, {K}] {x.dtype}")
        if token_adapter.dtype != torch.int32 or token_adapter.numel() != M:
            raise ValueError("token_adapter must be int32 [M]")
    if out is None:
        h = torch.empty((M, K), dtype=torch.float8_e4m3fn if quant else x.dtype, device=x.device)
        hs = torch.empty(M, dtype=torch.float32, device=x.device) if quant else None
        s = torch.empty((M, R), dtype=A.dtype, device=x.device) if A is not None else None
    else:
        h, hs, s = out
        if (h.shape != (M, K) or h.stride(1) != 1 or (hs is None) == quant or (s is None) != (A is None)
                or (s is not None and (s.shape != (M, R) or s.dtype != A.dtype))):
            raise ValueError("out (h, h_scale, s) does not fit this call (s: [M, R] in A's dtype)")
    use_amax = x_amax is not None and quant
    if use_amax and (x_amax.dim() != 2 or x_amax.shape[1] != M or x_amax.dtype != torch.float32
                     or (x_amax.stride(1) != 1 and M > 1)):  # [P, 1] from .contiguous() keeps any stride
        raise ValueError(f"x_amax must be fp32 [P, {M}] with contiguous rows, got {tuple(x_amax.shape)} {x_amax.dtype}")
    if M == 0:
        return h, hs, s
    if tma and use_amax and not config and gluon_prologue is not None and gluon_prologue.usable(x, A, h):
        gluon_prologue.prologue_ws(x, norm_weight, eps, A, token_adapter, x_amax, h, hs, s)
        return h, hs, s
    interpret = x.device.type == "cpu"
    BR = max(16, triton.next_power_of_2(max(R, 1)))
    cfg = {**prologue_tiles(K, R, BR, norm_weight is not None, quant, x.element_size(), interpret), **(config or {})}
    BM, BK = cfg["BM"], cfg["BK"]
    dummy = h
    _prologue_kernel[(triton.cdiv(M, BM),)](
        x, norm_weight if norm_weight is not None else dummy, A if A is not None else dummy, token_adapter,
        h, hs if hs is not None else dummy, s if s is not None else dummy, x_amax if use_amax else dummy,
        M, K, R, x_amax.shape[0] if use_amax else 0, eps, x.stride(0), h.stride(0), A.stride(0) if A is not None else 0,
        A.stride(1) if A is not None else 0, s.stride(0) if s is not None else 0, x_amax.stride(0) if use_amax else 0,
        NORM=norm_weight is not None, QUANT=quant, HAS_LORA=A is not None, HAS_AMAX=use_amax,
        ONE_AD=cfg["ONE_AD"] and A is not None,
        BM=BM, BK=BK, BR=BR, BP=PROLOGUE_BP,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", FAST=not interpret, num_warps=cfg["num_warps"],
        num_stages=cfg.get("num_stages", 3))
    return h, hs, s
