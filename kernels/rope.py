"""In-place q/k head norm + rotary embedding on the fused qkv projection, before attention reads it.

Semantics: reference.rope_qk — for every k head (and q head, with rotate_q) of qkv [T, (H + 2 Hkv) D]:
per-head RMSNorm (Qwen3, rounded to qkv's dtype), then rotate-half rope at positions[t] in fp32, rounded to
qkv's dtype; v untouched.

Why k gets a pass of its own: inside the attention kernel, K was rotated once per query block that read it
(each key tile about cdiv(len, 64) times) and the score took two half-width dots: attention cost 0.74 s of
W1's 5.3 s GPU time (run 5) against 0.41 s without rope (run 2). Here every key row is rotated once and the
prefix cache stores rotated keys. q is read once by the attention, which rotates it (rotate_rows, in place)
as it loads it: the engine passes rotate_q=False (per 16k batch and layer the q and k pass took 71 us at
W1's heads, the k pass 14; bench/sweep.py attention, run 52).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .reference import AttnShape


@triton.jit
def rotate_rows(base, row_ok, pos, cos_ptr, sin_ptr, nw_ptr, eps,
                HALF: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr, CH: tl.constexpr):
    """In place: each of the rows (base [R]: pointers to a head's first element; pos [R]: its position)
    normed by nw (NORM) and rotated, as reference.rope_q; CH columns of each half at a time (registers)."""
    rstd = tl.full(row_ok.shape, 1.0, dtype=tl.float32)
    if NORM:
        ss = tl.zeros(row_ok.shape, dtype=tl.float32)
        for c0 in tl.static_range(0, BH, CH):
            rh = c0 + tl.arange(0, CH)
            m = row_ok[:, None] & (rh < HALF)[None, :]
            x1 = tl.load(base[:, None] + rh[None, :], mask=m, other=0.0).to(tl.float32)
            x2 = tl.load(base[:, None] + HALF + rh[None, :], mask=m, other=0.0).to(tl.float32)
            ss += tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)
        rstd = 1.0 / tl.sqrt(ss / (2 * HALF) + eps)
    for c0 in tl.static_range(0, BH, CH):
        rh = c0 + tl.arange(0, CH)
        h_ok = rh < HALF
        m = row_ok[:, None] & h_ok[None, :]
        ptrs = base[:, None] + rh[None, :]
        x1 = tl.load(ptrs, mask=m, other=0.0)
        x2 = tl.load(ptrs + HALF, mask=m, other=0.0)
        dt = x1.dtype
        a, b = x1.to(tl.float32), x2.to(tl.float32)
        if NORM:
            w1 = tl.load(nw_ptr + rh, mask=h_ok, other=0.0).to(tl.float32)
            w2 = tl.load(nw_ptr + HALF + rh, mask=h_ok, other=0.0).to(tl.float32)
            a = (a * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
            b = (b * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
        c = tl.load(cos_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
        s = tl.load(sin_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
        tl.store(ptrs, (a * c - b * s).to(dt), mask=m)
        tl.store(ptrs + HALF, (b * c + a * s).to(dt), mask=m)


@triton.jit
def _rope_kernel(qkv_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, T, H, head0, stride_t, eps,
                 HALF: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    head = head0 + tl.program_id(1)  # 0 .. H-1: q heads, H ..: k heads
    m_ok = rm < T
    pos = tl.load(pos_ptr + rm, mask=m_ok, other=0)
    rotate_rows(qkv_ptr + rm * stride_t + head * 2 * HALF, m_ok, pos, cos_ptr, sin_ptr,
                tl.where(head < H, qn_ptr, kn_ptr), eps, HALF, BH, NORM, BH)


def rope_qk(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shape: AttnShape,
            q_norm: torch.Tensor | None = None, k_norm: torch.Tensor | None = None, eps: float = 1e-6,
            rotate_q: bool = True) -> torch.Tensor:
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
    if rotate_q and (q_norm is None) != (k_norm is None):
        raise ValueError("q_norm and k_norm come together")
    if not rotate_q and q_norm is not None:
        raise ValueError("q_norm belongs to the attention's QRope when q is not rotated here")
    if T == 0:
        return qkv
    BM = 16 if qkv.device.type == "cpu" else 64
    # the kernel selects between the two weights, so both need one pointer type (an absent one is never read)
    kn = k_norm if k_norm is not None else cos
    qn = q_norm if q_norm is not None else kn
    _rope_kernel[(triton.cdiv(T, BM), H + Hkv if rotate_q else Hkv)](
        qkv, positions, cos, sin, qn, kn,
        T, H, 0 if rotate_q else H, qkv.stride(0), eps, HALF=D // 2, BM=BM, BH=max(16, triton.next_power_of_2(D // 2)),
        NORM=k_norm is not None, num_warps=4)
    return qkv
