"""Causal attention over packed variable-length sequences (flash-attention style, online softmax).

Semantics: for each sequence b and head h, softmax(q k^T * scale + causal [+ window] mask) v with kv head
h // (H // Hkv), fp32 inside, rounded to q's dtype — reference.varlen_attention. With last_only, q holds
one row per sequence (its last token), as the last layer needs.

Batch invariance: one program owns one (query block, sequence, head) and walks that sequence's keys in a
fixed order, so nothing outside the sequence changes its result.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _attn_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, cu_ptr,
    scale, window, H, KV_GROUP, D,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh,
    LAST_ONLY: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr,
):
    mblk, b, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start = tl.load(cu_ptr + b)
    n_keys = tl.load(cu_ptr + b + 1) - start
    if LAST_ONLY:
        q_start, n_q = b, 1
    else:
        q_start, n_q = start, n_keys
    if mblk * BM >= n_q:
        return
    kvh = h // KV_GROUP
    rm = mblk * BM + tl.arange(0, BM)
    qpos = n_keys - n_q + rm  # position of each query inside its sequence
    rd = tl.arange(0, BD)
    m_ok = rm < n_q
    d_ok = rd < D
    q = tl.load(q_ptr + (q_start + rm)[:, None] * stride_qt + h * stride_qh + rd[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BM,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BM,), dtype=tl.float32)
    acc = tl.zeros((BM, BD), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    hi = tl.minimum(n_keys, n_keys - n_q + (mblk + 1) * BM)
    lo = 0
    if window > 0:
        lo = tl.maximum(n_keys - n_q + mblk * BM - window + 1, 0) // BN * BN
    for n0 in range(lo, hi, BN):
        rn = n0 + tl.arange(0, BN)
        n_ok = rn < n_keys
        kt = tl.load(k_ptr + (start + rn)[:, None] * stride_kt + kvh * stride_kh + rd[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(kt), input_precision=PREC) * qk_scale
        ok = (rn[None, :] <= qpos[:, None]) & n_ok[None, :]
        if window > 0:
            ok = ok & (rn[None, :] > qpos[:, None] - window)
        s = tl.where(ok, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        vt = tl.load(v_ptr + (start + rn)[:, None] * stride_vt + kvh * stride_vh + rd[None, :],
                     mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(vt.dtype), vt, input_precision=PREC)
        m_i = m_new
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(o_ptr + (q_start + rm)[:, None] * stride_ot + h * stride_oh + rd[None, :],
             out.to(o_ptr.dtype.element_ty), mask=m_ok[:, None] & d_ok[None, :])


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
                     scale: float, window: int | None = None, last_only: bool = False,
                     max_seqlen: int | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """Launcher; same semantics as reference.varlen_attention. q [Tq, H, D], k/v [T, Hkv, D]; `out` (like q)
    is written in place when given."""
    Tq, H, D = q.shape
    T, Hkv, Dk = k.shape
    if Dk != D or v.shape != k.shape or H % Hkv or q.dtype != k.dtype or k.dtype != v.dtype:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("q, k, v need a contiguous head dimension")
    B = cu_seqlens.numel() - 1
    if cu_seqlens.dtype != torch.int32 or (last_only and Tq != B):
        raise ValueError("cu_seqlens must be int32 [B+1]; with last_only, q has one row per sequence")
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(2) != 1:
        raise ValueError("out must be shaped and typed like q")
    if B == 0:
        return out
    if max_seqlen is None:
        max_seqlen = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    interpret = q.device.type == "cpu"
    BM, BN = (16, 16) if interpret else (64, 64)
    n_q = 1 if last_only else max_seqlen
    grid = (triton.cdiv(n_q, BM), B, H)
    _attn_kernel[grid](
        q, k, v, out, cu_seqlens, scale, window or 0, H, H // Hkv, D,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.stride(0), out.stride(1),
        LAST_ONLY=last_only, BM=BM, BN=BN, BD=max(16, triton.next_power_of_2(D)),
        PREC="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4, num_stages=2 if not interpret else 1)
    return out
