"""Prologue of a linear layer: RMSNorm (or nothing), per-token FP8 quantization and the LoRA shrink.

Semantics: h = rmsnorm(x, w) if a norm weight is given else x, rounded to x.dtype;
(h8, h_scale) = quantize_rows(h) when quantizing (else h itself); s = h @ A[token_adapter].T in fp32
(zeros for adapter -1) — reference.prologue.

The shrink reads the 16-bit h, never the FP8 one (DESIGN.md). One program owns BM rows and sweeps K in
chunks twice: once for the row statistics (norm, amax), once to write and shrink; the second sweep runs
backwards, so it starts on the chunks most likely still in L2. Both sweeps are fed by TMA, which the compiler
pipelines: with pointer loads each sweep was a chain of dependent DRAM round trips (run 29: 499 -> 452 us per
W1 layer on 16k tokens). Three sweeps with 16-row programs took 1.10 s of W1's 6.3 s GPU time (NOTES.md).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triton.tools.tensor_descriptor import TensorDescriptor

from .launch import tma_ok

FP8_MAX = 448.0


@triton.jit
def _x_chunk(x_ptr, x_desc, rm, m_ok, rk, K, stride_xm, blk, k, BM: tl.constexpr, BK: tl.constexpr, TMA: tl.constexpr):
    """Rows rm, columns rk of x; zeros outside. The compiler pipelines descriptor (TMA) loads in a loop
    without a dot, but not pointer loads: the sweeps were latency chains (run 28)."""
    if TMA:
        return x_desc.load([blk * BM, k * BK])
    return tl.load(x_ptr + rm[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & (rk[None, :] < K), other=0.0)


@triton.jit
def _h_chunk(x_ptr, x_desc, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, blk, k, NORM: tl.constexpr, BM: tl.constexpr,
             BK: tl.constexpr, TMA: tl.constexpr):
    x = _x_chunk(x_ptr, x_desc, rm, m_ok, rk, K, stride_xm, blk, k, BM, BK, TMA)
    if NORM:
        w = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
        h = (x.to(tl.float32) * rstd[:, None] * w[None, :]).to(x.dtype)
    else:
        h = x
    return h


@triton.jit
def _shrink_chunk(h, a_ptr, a_desc, a_id, rr, rk, R, K, stride_an, stride_ar, k, BK: tl.constexpr,
                  PREC: tl.constexpr, TMA: tl.constexpr):
    if TMA:  # a_desc views A as [adapters * R, K]: rows past R are the next adapter's, their sums unused
        at = a_desc.load([a_id * R, k * BK])
    else:
        at = tl.load(a_ptr + a_id * stride_an + rr[:, None] * stride_ar + rk[None, :],
                     mask=(rr[:, None] < R) & (rk[None, :] < K), other=0.0)
    return tl.dot(h.to(at.dtype), tl.trans(at), input_precision=PREC)


@triton.jit
def _prologue_kernel(
    x_ptr, x_desc, nw_ptr, a_ptr, a_desc, ad_ptr, h_ptr, hs_ptr, s_ptr,
    M, K, R, eps,
    stride_xm, stride_hm, stride_an, stride_ar, stride_sm,
    NORM: tl.constexpr, QUANT: tl.constexpr, HAS_LORA: tl.constexpr,
    BM: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr, NS: tl.constexpr, REV: tl.constexpr,
    TMA: tl.constexpr,
):
    blk = tl.program_id(0)
    rm = blk * BM + tl.arange(0, BM)
    m_ok = rm < M
    nk = tl.cdiv(K, BK)
    # One sweep for the row statistics: the norm's sum of squares and the amax that sets the FP8 scale.
    # amax(rmsnorm(x)) = rstd * amax(x * w), so a normed row needs no extra sweep.
    rstd = tl.zeros((BM,), dtype=tl.float32)
    scale = tl.full((BM,), 1.0, dtype=tl.float32)
    if NORM or QUANT:
        ss = tl.zeros((BM,), dtype=tl.float32)
        mx = tl.zeros((BM,), dtype=tl.float32)
        for k in tl.range(0, nk, num_stages=NS):
            rk = k * BK + tl.arange(0, BK)
            x = _x_chunk(x_ptr, x_desc, rm, m_ok, rk, K, stride_xm, blk, k, BM, BK, TMA).to(tl.float32)
            if NORM:
                ss += tl.sum(x * x, axis=1)
                w = tl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(tl.float32)
                mx = tl.maximum(mx, tl.max(tl.abs(x * w[None, :]), axis=1))
            else:
                mx = tl.maximum(mx, tl.max(tl.abs(x), axis=1))
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
        lo = tl.minimum(lo, tl.maximum(hi, 0))  # a block without adapter rows shrinks against adapter 0, unused
    # The second sweep writes h and shrinks for the block's first adapter only: no loop nested in it, so it
    # is pipelined too. Rows are sorted by adapter, so few blocks hold a second one (the sweep below).
    for kk in tl.range(0, nk, num_stages=NS):
        # REV: the second sweep starts with the chunks the first read last, the ones most likely still in L2
        k = nk - 1 - kk if REV else kk
        rk = k * BK + tl.arange(0, BK)
        h = _h_chunk(x_ptr, x_desc, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, blk, k, NORM, BM, BK, TMA)
        out_ptrs = h_ptr + rm[:, None] * stride_hm + rk[None, :]
        mask = m_ok[:, None] & (rk[None, :] < K)
        if QUANT:
            q = tl.clamp(h.to(tl.float32) / scale[:, None], -448.0, 448.0)
            tl.store(out_ptrs, q.to(h_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(out_ptrs, h.to(h_ptr.dtype.element_ty), mask=mask)
        if HAS_LORA:
            # masked before the add, which also keeps each chunk's dot from accumulating into sacc inside the
            # tensor core: summed there, the shrink's error tripled (run 30, M = 300, K = 3072, r = 16)
            part = _shrink_chunk(h, a_ptr, a_desc, lo, rr, rk, R, K, stride_an, stride_ar, k, BK, PREC, TMA)
            sacc += tl.where((ad == lo)[:, None], part, 0.0)
    if HAS_LORA:
        for a_id in range(lo + 1, hi + 1):
            for kk in range(0, nk):  # same K order as above, so a row's sum does not depend on its block
                k = nk - 1 - kk if REV else kk
                rk = k * BK + tl.arange(0, BK)
                h = _h_chunk(x_ptr, x_desc, nw_ptr, rm, m_ok, rk, K, stride_xm, rstd, blk, k, NORM, BM, BK, TMA)
                part = _shrink_chunk(h, a_ptr, a_desc, a_id, rr, rk, R, K, stride_an, stride_ar, k, BK, PREC, TMA)
                sacc += tl.where((ad == a_id)[:, None], part, 0.0)
        tl.store(s_ptr + rm[:, None] * stride_sm + rr[None, :], sacc, mask=m_ok[:, None] & (rr[None, :] < R))


def prologue(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float,
             A: torch.Tensor | None, token_adapter: torch.Tensor, quant: bool,
             out: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None = None,
             config: dict | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Launcher; same semantics as reference.prologue. x [M, K]; `out`
    (h, h_scale, s) is written in place when given; `config` (BM, BK, num_warps) overrides the tile choice
    (bench/sweep.py)."""
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
    if M == 0:
        return h, hs, s
    interpret = x.device.type == "cpu"
    # Per kind, from bench/sweep.py at W1's and W4's shapes, 16k-token batches (run 29, NOTES.md): TMA-fed,
    # the second sweep reversed, 4 warps. A 48-rank shrink (qkv) wants 64-wide chunks and 4 stages (111 us at
    # K = 3072 on 32-row programs, 74 us at K = 2048 on 64-row ones); the other normed one 32x128 (99 us), the
    # plain ones 32x256 (o 64 us, down 174 us). The choice depends on K and R only, never on M (batch
    # invariance).
    if interpret:
        cfg = dict(BM=16, BK=32)
    elif norm_weight is not None and R > 32:
        cfg = dict(BM=64 if K <= 2048 else 32, BK=64, NS=4)
    elif norm_weight is not None:
        cfg = dict(BM=32, BK=128)
    else:
        cfg = dict(BM=32, BK=256)
    cfg.update(num_warps=4, TMA=True, REV=True)
    cfg["BK"] = min(cfg["BK"], max(16, triton.next_power_of_2(K)))
    cfg.update(config or {})
    BM, BK = cfg["BM"], cfg["BK"]
    dummy = h
    BR = max(16, triton.next_power_of_2(max(R, 1)))
    tma = cfg.get("TMA", False) and tma_ok(x) and (A is None or (A.is_contiguous() and tma_ok(A.view(-1, K))))
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK]) if tma else x
    a_desc = TensorDescriptor.from_tensor(A.view(-1, K), [BR, BK]) if tma and A is not None else dummy
    _prologue_kernel[(triton.cdiv(M, BM),)](
        x, x_desc, norm_weight if norm_weight is not None else dummy, A if A is not None else dummy, a_desc,
        token_adapter,
        h, hs if hs is not None else dummy, s if s is not None else dummy,
        M, K, R, eps, x.stride(0), h.stride(0), A.stride(0) if A is not None else 0,
        A.stride(1) if A is not None else 0, s.stride(0) if s is not None else 0,
        NORM=norm_weight is not None, QUANT=quant, HAS_LORA=A is not None,
        BM=BM, BK=BK, BR=BR,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", NS=cfg.get("NS"), REV=cfg["REV"], TMA=tma,
        num_warps=cfg["num_warps"])
    return h, hs, s
