"""In-place q/k head norm + rotary embedding on the fused qkv projection, before attention reads it.

Semantics: reference.rope_qk — for every q and k head of qkv [T, (H + 2 Hkv) D]: per-head RMSNorm (Qwen3,
rounded to qkv's dtype), then rotate-half rope at positions[t] in fp32, rounded to qkv's dtype; v untouched.

Why a pass of its own: inside the attention kernel, K was rotated once per query block that read it (each
key tile about cdiv(len, 64) times) and the score took two half-width dots: attention cost 0.74 s of W1's
5.3 s GPU time (run 5) against 0.41 s without rope (run 2). Here every row is rotated once, ~30 us per
16k-token batch and layer (reads and writes the q and k columns), and the prefix cache stores rotated rows.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import AttnShape


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, T, H, stride_t, eps,
                 HALF: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    head = tl.program_id(1)  # 0 .. H-1: q heads, H ..: k heads
    rh = tl.arange(0, BH)
    m_ok, h_ok = rm < T, rh < HALF
    m = m_ok[:, None] & h_ok[None, :]
    base = qkv_ptr + rm[:, None] * stride_t + head * 2 * HALF + rh[None, :]
    x1 = tl.load(base, mask=m, other=0.0)
    x2 = tl.load(base + HALF, mask=m, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        nw = tl.where(head < H, qn_ptr, kn_ptr)
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(nw + rh, mask=h_ok, other=0.0).to(tl.float32)
        w2 = tl.load(nw + HALF + rh, mask=h_ok, other=0.0).to(tl.float32)
        a = (a * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
        b = (b * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
    pos = tl.load(pos_ptr + rm, mask=m_ok, other=0)
    c = tl.load(cos_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    tl.store(base, (a * c - b * s).to(dt), mask=m)
    tl.store(base + HALF, (b * c + a * s).to(dt), mask=m)


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: AttnShape,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Launcher; same semantics as reference.rope_qk (in place, returns qkv). positions [T] int64 must lie
    inside the cos/sin tables (the caller sizes them: Decoder.rope_tables)."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * Hkv) * D or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {H}+2x{Hkv} heads of {D} contiguously")
    if cos.shape != sin.shape or cos.shape[1] != D // 2 or not cos.is_contiguous() or cos.dtype != torch.float32:
        raise ValueError(f"cos/sin must be contiguous fp32 [positions, {D // 2}], got {tuple(cos.shape)}")
    if positions.shape != (T,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be int64 [{T}], got {positions.dtype} {tuple(positions.shape)}")
    if (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if T == 0:
        return qkv
    BM = 16 if qkv.device.type == "cpu" else 64
    _rope_kernel[(triton.cdiv(T, BM), H + Hkv)](
        qkv, positions, cos, sin, q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
        T, H, qkv.stride(0), eps, HALF=D // 2, BM=BM, BH=max(16, triton.next_power_of_2(D // 2)),
        NORM=q_norm is not None, num_warps=4)
    return qkv
