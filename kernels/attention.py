"""Causal attention over packed variable-length sequences, reading the fused qkv projection directly.

Semantics: reference.varlen_attention — per-head RMSNorm of q and k (Qwen3), rotary embedding at each
token's position in its sequence, then causal softmax(q k^T * scale) v per sequence (GQA, optional sliding
window), fp32 inside, rounded to qkv's dtype. With last_only only each sequence's last token queries.

Why norm and rope live here: done as torch ops they cost about ten elementwise kernels per layer, 1.3 s of
W1's 6.3 s GPU time (profile, bench/NOTES.md); here they are a few multiplies on tiles already loaded.
Batch invariance: one program owns one (query block, sequence, head) and walks that sequence's keys in a
fixed order, so nothing outside the sequence changes its result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import AttnShape, PrefixKV


@triton.jit
def _load_rot(row_ptrs, pos, ok, col0, cos_ptr, sin_ptr, nw_ptr, eps,
              HALF: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr):
    """One head of the given rows as two halves [R, BH], per-head RMSNorm'd and rotated to `pos`, rounded
    to the input dtype."""
    rh = tl.arange(0, BH)
    h_ok = rh < HALF
    m = ok[:, None] & h_ok[None, :]
    base = row_ptrs[:, None] + col0 + rh[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(nw_ptr + rh, mask=h_ok, other=0.0).to(tl.float32)
        w2 = tl.load(nw_ptr + HALF + rh, mask=h_ok, other=0.0).to(tl.float32)
        a = (a * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
        b = (b * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    return (a * c - b * s).to(dt), (b * c + a * s).to(dt)


@triton.jit
def _attn_kernel(
    qkv_ptr, o_ptr, cu_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, pre_ptr, pre_start_ptr, pre_len_ptr,
    scale, eps, window, KV_GROUP,
    stride_t, stride_ot, stride_pre, K_COL, V_COL,
    HALF: tl.constexpr, LAST_ONLY: tl.constexpr, NORM: tl.constexpr, HAS_PREFIX: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, PREC: tl.constexpr,
):
    mblk, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n_own = tl.load(cu_ptr + b + 1) - start
    n_q = 1 if LAST_ONLY else n_own
    if mblk * BM >= n_q:
        return
    P = 0
    p0 = 0
    if HAS_PREFIX:
        P = tl.load(pre_len_ptr + b)
        p0 = tl.load(pre_start_ptr + b)
    # Keys are enumerated as one sequence, cached prefix first, in the same BN blocks as when the prefix is
    # computed inline: the reduction order, and so every bit of the result, is the same either way.
    n_keys = P + n_own
    kvh = h // KV_GROUP
    D = 2 * HALF
    rm = mblk * BM + tl.arange(0, BM)
    m_ok = rm < n_q
    qpos = n_keys - n_q + rm  # position of each query in the sequence, prefix included
    q1, q2 = _load_rot(qkv_ptr + (start + qpos - P) * stride_t, qpos, m_ok, h * D, cos_ptr, sin_ptr, qn_ptr,
                       eps, HALF, BH, NORM)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    rh = tl.arange(0, BH)
    h_ok = rh < HALF
    acc1 = tl.zeros((BM, BH), dtype=tl.float32)
    acc2 = tl.zeros((BM, BH), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    hi = tl.minimum(n_keys, n_keys - n_q + (mblk + 1) * BM)
    lo = 0
    if window > 0:
        lo = tl.maximum(n_keys - n_q + mblk * BM - window + 1, 0) // BN * BN
    for n0 in range(lo, hi, BN):
        rn = n0 + tl.arange(0, BN)
        n_ok = rn < n_keys
        rows = qkv_ptr + (start + rn - P) * stride_t
        if HAS_PREFIX:
            rows = tl.where(rn < P, pre_ptr + (p0 + rn) * stride_pre, rows)
        k1, k2 = _load_rot(rows, rn, n_ok, K_COL + kvh * D, cos_ptr, sin_ptr, kn_ptr, eps, HALF, BH, NORM)
        s = tl.dot(q1, tl.trans(k1), input_precision=PREC)
        s = tl.dot(q2, tl.trans(k2), s, input_precision=PREC) * qk_scale
        ok = (rn[None, :] <= qpos[:, None]) & n_ok[None, :]
        if window > 0:
            ok = ok & (rn[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vb = rows[:, None] + V_COL + kvh * D + rh[None, :]
        vm = n_ok[:, None] & h_ok[None, :]
        v1 = tl.load(vb, mask=vm, other=0.0)
        v2 = tl.load(vb + HALF, mask=vm, other=0.0)
        pv = p.to(v1.dtype)
        acc1 = acc1 * alpha[:, None] + tl.dot(pv, v1, input_precision=PREC)
        acc2 = acc2 * alpha[:, None] + tl.dot(pv, v2, input_precision=PREC)
        m_i = m_new
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    orow = b + rm if LAST_ONLY else start + rm  # last_only: row b holds sequence b (rm > 0 is masked)
    ob = o_ptr + orow[:, None] * stride_ot + h * D + rh[None, :]
    om = m_ok[:, None] & h_ok[None, :]
    tl.store(ob, (acc1 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=om)
    tl.store(ob + HALF, (acc2 * inv[:, None]).to(o_ptr.dtype.element_ty), mask=om)


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     shape: AttnShape, scale: float, window: int | None = None,
                     q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
                     last_only: bool = False, max_seqlen: int | None = None,
                     prefix: PrefixKV | None = None, out: torch.Tensor | None = None,
                     config: dict | None = None) -> torch.Tensor:
    """Launcher; same semantics as reference.varlen_attention. qkv [T, (H + 2 Hkv) D]; cos/sin fp32 [P, D/2]
    covering every position; `out` [Tq, H D] is written in place when given; `config` (BM, BN, num_warps,
    num_stages) overrides the tile choice (bench/sweep.py)."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * Hkv) * D or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {H}+2x{Hkv} heads of {D} contiguously")
    if cos.shape != sin.shape or cos.shape[1] != D // 2 or not cos.is_contiguous() or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be contiguous fp32 [positions, {D // 2}], got {tuple(cos.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    B = cu_seqlens.numel() - 1
    if cu_seqlens.dtype != torch.int32:
        raise ValueError("cu_seqlens must be int32 [B+1]")
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if B else 0
    if prefix is not None:
        if prefix.rows.shape[1] != qkv.shape[1] or prefix.rows.dtype != qkv.dtype or prefix.rows.stride(1) != 1:
            raise ValueError(f"prefix rows {tuple(prefix.rows.shape)} {prefix.rows.dtype} do not match qkv")
        if prefix.start.dtype != torch.int32 or prefix.length.dtype != torch.int32 or prefix.start.numel() != B:
            raise ValueError("prefix start/length must be int32 [B]")
    reach = max_seqlen + (int(prefix.length.max()) if prefix is not None and B else 0)
    if reach > cos.shape[0]:
        raise ValueError(f"rotary table covers {cos.shape[0]} positions, sequences reach {reach}")
    rows = B if last_only else T
    if out is None:
        out = torch.empty((rows, H * D), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (rows, H * D) or out.dtype != qkv.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {H * D}] {qkv.dtype}")
    if B == 0:
        return out
    interpret = qkv.device.type == "cpu"
    cfg = dict(BM=16, BN=16, num_warps=4, num_stages=1) if interpret else \
        dict(BM=64, BN=64, num_warps=4, num_stages=2)
    cfg.update(config or {})
    BM, BN = (16, cfg["BN"]) if last_only else (cfg["BM"], cfg["BN"])  # last_only: one query per sequence
    grid = (triton.cdiv(1 if last_only else max_seqlen, BM), B, H)
    _attn_kernel[grid](
        qkv, out, cu_seqlens, cos, sin, q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
        prefix.rows if prefix is not None else qkv, prefix.start if prefix is not None else cu_seqlens,
        prefix.length if prefix is not None else cu_seqlens,
        scale, eps, window or 0, H // Hkv, qkv.stride(0), out.stride(0),
        prefix.rows.stride(0) if prefix is not None else 0, H * D, (H + Hkv) * D,
        HALF=D // 2, LAST_ONLY=last_only, NORM=q_norm is not None, HAS_PREFIX=prefix is not None, BM=BM, BN=BN,
        BH=max(16, triton.next_power_of_2(D // 2)), PREC="ieee" if qkv.dtype == torch.float32 else "tf32",
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out
