"""Prologue of a linear layer: RMSNorm (or nothing), per-token FP8 quantization and the LoRA shrink.

Semantics: h = rmsnorm(x, w) if a norm weight is given else x, rounded to x.dtype;
(h8, h_scale) = quantize_rows(h) when quantizing (else h itself); s = h @ A[token_adapter].T in fp32
(zeros for adapter -1) — reference.prologue.

The shrink reads the 16-bit h, never the FP8 one (DESIGN.md). One program owns BM rows and sweeps K in
chunks twice: once for the row statistics (norm, amax), once to write and shrink; the second read of its
rows hits L2. Three sweeps with 16-row programs took 1.10 s of W1's 6.3 s GPU time (bench/NOTES.md).
Without a norm the statistics are only the amax, and the kernels that write the o and down projections'
inputs (attention, the gate/up GEMM's SiLU epilogue) leave partial row maxima of what they stored
(x_amax): the max of those is the amax exactly, so those prologues sweep once (W1 +1.3%, W4 +2.9%, run 47).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX = 448.0


@triton.jit
def _h_chunk(x_ptr, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, NORM: tl.constexpr):
    k_ok = rk < K
    mask = m_ok[:, None] & k_ok[None, :]
    x = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=mask, other=0.0)
    if NORM:
        w = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
        h = (x.to(tl.float32) * rstd[:, None] * w[None, :]).to(x.dtype)
    else:
        h = x
    return h


@triton.jit
def _prologue_kernel(
    x_ptr, nw_ptr, a_ptr, ad_ptr, h_ptr, hs_ptr, s_ptr, amax_ptr,
    M, K, R, P, eps,
    stride_xm, stride_hm, stride_an, stride_ar, stride_sm, stride_ap,
    NORM: tl.constexpr, QUANT: tl.constexpr, HAS_LORA: tl.constexpr, HAS_AMAX: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, BP: tl.constexpr, PREC: tl.constexpr,
):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    m_ok = rm < M
    nk = tl.cdiv(K, BK)
    # One sweep for the row statistics: the norm's sum of squares and the amax that sets the FP8 scale.
    # amax(rmsnorm(x)) = rstd * amax(x * w), so a normed row needs no extra sweep.
    rstd = tl.zeros((BM,), dtype=tl.float32)
    scale = tl.full((BM,), 1.0, dtype=tl.float32)
    if HAS_AMAX:
        # the kernel that wrote x left partial row maxima [P, M]: their max is the row's amax, exactly
        mx = tl.zeros((BM,), dtype=tl.float32)
        for p0 in range(0, P, BP):
            rp = p0 + tl.arange(0, BP)
            part = tl.load(amax_ptr + rp[:, None] * stride_ap + rm[None, :], mask=(rp[:, None] < P) & m_ok[None, :],
                           other=0.0)
            mx = tl.maximum(mx, tl.max(part, axis=0))
        scale = tl.where(mx > 0, mx / 448.0, 1.0)
        tl.store(hs_ptr + rm, scale, mask=m_ok)
    elif NORM or QUANT:
        ss = tl.zeros((BM,), dtype=tl.float32)
        mx = tl.zeros((BM,), dtype=tl.float32)
        for k in range(0, nk):
            rk = k * BK + tl.arange(0, BK)
            if NORM:
                k_ok = rk < K
                xr = tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :],
                             other=0.0)
                x = xr.to(tl.float32)
                ss += tl.sum(x * x, axis=1)
                w = tl.load(nw_ptr + rk, mask=k_ok, other=0.0).to(tl.float32)
                mx = tl.maximum(mx, tl.max(tl.abs(x * w[None, :]), axis=1))
            else:
                h = _h_chunk(x_ptr, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, NORM).to(tl.float32)
                mx = tl.maximum(mx, tl.max(tl.abs(h), axis=1))
        if NORM:
            rstd = 1.0 / tl.sqrt(ss / K + eps)
            # the reference takes amax of h rounded to the input dtype; rounding is monotonic
            mx = (mx * rstd).to(x_ptr.dtype.element_ty).to(tl.float32)
        if QUANT:
            scale = tl.where(mx > 0, mx / 448.0, 1.0)
            tl.store(hs_ptr + rm, scale, mask=m_ok)
    rr = tl.arange(0, BR)
    sacc = tl.zeros((BM, BR), dtype=tl.float32)
    lo = 0
    hi = -1
    ad = tl.full((BM,), -1, dtype=tl.int32)
    if HAS_LORA:
        ad = tl.load(ad_ptr + rm, mask=m_ok, other=-1)
        lo = tl.min(tl.where(ad >= 0, ad, 2147483647), axis=0)
        hi = tl.max(ad, axis=0)
    for k in range(0, nk):
        rk = k * BK + tl.arange(0, BK)
        mask = m_ok[:, None] & (rk[None, :] < K)
        h = _h_chunk(x_ptr, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, NORM)
        out_ptrs = h_ptr + rm[:, None] * stride_hm + rk[None, :]
        if QUANT:
            q = tl.clamp(h.to(tl.float32) / scale[:, None], -448.0, 448.0)
            tl.store(out_ptrs, q.to(h_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)
        if HAS_LORA:
            for a_id in range(lo, hi + 1):  # rows are sorted by adapter: usually one pass
                at = tl.load(a_ptr + a_id * stride_an + rr[:, None] * stride_ar + rk[None, :],
                             mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
                part = tl.dot(h.to(at.dtype), tl.trans(at), input_precision=PREC)
                sacc += tl.where((ad == a_id)[:, None], part, 0.0)
    if HAS_LORA:
        tl.store(s_ptr + rm[:, None] * stride_sm + rr[None, :], sacc, mask=m_ok[:, None] & (rr[None, :] < R))


def prologue(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
             A: torch.Tensor | None, token_adapter: torch.Tensor, quant: bool,
             out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
             config: dict | None = None, x_amax: torch.Tensor | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launcher; same semantics as reference.prologue. x [M, K]; `out`
    (h, h_scale, s) is written in place when given; `config` (BM, BK, num_warps) overrides the tile choice
    (bench/sweep.py); x_amax [P, M] fp32, partial row maxima of |x| (lora_gemm's and varlen_attention's
    row_amax), spares the statistics sweep of a quantizing prologue without a norm."""
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
        s = torch.empty((M, R), dtype=torch.float32, device=x.device) if A is not None else None
    else:
        h, hs, s = out
        if h.shape != (M, K) or h.stride(1) != 1 or (hs is None) == quant or (s is None) != (A is None):
            raise ValueError("out (h, h_scale, s) does not fit this call")
    use_amax = x_amax is not None and quant and norm_weight is None
    if use_amax and (x_amax.dim() != 2 or x_amax.shape[1] != M or x_amax.dtype != torch.float32
                     or x_amax.stride(1) != 1):
        raise ValueError(f"x_amax must be fp32 [P, {M}] with contiguous rows, got {tuple(x_amax.shape)} {x_amax.dtype}")
    if M == 0:
        return h, hs, s
    interpret = x.device.type == "cpu"
    # Per kind, from bench/sweep.py at W1's shapes (run 4): norm 105 us (gate_up), plain 75 us (o_proj)
    # per 16k-token batch; a shrink of more than 32 ranks (qkv: 48) was best with 64-row programs and
    # 8 warps (124 us, run 4). The choice depends on K and R only, never on M (batch invariance).
    if interpret:
        cfg = dict(BM=16, BK=32, num_warps=4)
    elif norm_weight is not None and R > 32:
        cfg = dict(BM=64, BK=128, num_warps=8)
    elif norm_weight is not None:
        cfg = dict(BM=32, BK=128, num_warps=4)
    else:
        cfg = dict(BM=32, BK=256, num_warps=4)
    cfg["BK"] = min(cfg["BK"], max(16, triton.next_power_of_2(K)))
    cfg.update(config or {})
    BM, BK = cfg["BM"], cfg["BK"]
    dummy = h
    _prologue_kernel[(triton.cdiv(M, BM),)](
        x, norm_weight if norm_weight is not None else dummy, A if A is not None else dummy, token_adapter,
        h, hs if hs is not None else dummy, s if s is not None else dummy, x_amax if use_amax else dummy,
        M, K, R, x_amax.shape[0] if use_amax else 0, eps, x.stride(0), h.stride(0), A.stride(0) if A is not None else 0,
        A.stride(1) if A is not None else 0, s.stride(0) if s is not None else 0, x_amax.stride(0) if use_amax else 0,
        NORM=norm_weight is not None, QUANT=quant, HAS_LORA=A is not None, HAS_AMAX=use_amax,
        BM=BM, BK=BK, BR=max(16, triton.next_power_of_2(max(R, 1))), BP=16,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", num_warps=cfg["num_warps"])
    return h, hs, s
