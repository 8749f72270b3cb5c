"""In-place head norm + rotary embedding of a projection's q and k heads: the pass lora_gemm runs after a GEMM
that did not rotate them itself.

Semantics: reference.rope_cols — every head in columns [0, cols) of y: per-head RMSNorm (Qwen3; q_norm for
the q heads [0, q_cols), k_norm for the rest, rounded to y's dtype), then rotate-half rope at positions[t] in
fp32, rounded to y's dtype.

Where it runs: the Gluon GEMM (FP8, 1024 rows or more) rotates heads without norms in its epilogue with these
very instructions (gluon_rope.py), so the rows are bitwise the same either way. This pass is for the rest:
small batches (the Triton GEMM), 16 bits, and Qwen3's normed heads.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyscan.kernels.reference import RopeCols
from policyscan.kernels.tuning import rope_tiles


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@triton.jit(do_not_specialize=["T"])
def _rope_kernel(y_ptr, pos_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, T, q_heads, stride_t, eps,
                 HALF: tl.constexpr, BM: tl.constexpr, BH: tl.constexpr, NORM: tl.constexpr):
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    head = tl.program_id(1)  # 0 .. q_heads - 1: q heads, then k heads
    row_ok = rm < T
    pos = tl.load(pos_ptr + rm, mask=row_ok, other=0)
    base = y_ptr + rm * stride_t + head * 2 * HALF
    rh = tl.arange(0, BH)
    h_ok = rh < HALF
    m = row_ok[:, None] & h_ok[None, :]
    ptrs = base[:, None] + rh[None, :]
    x1 = tl.load(ptrs, mask=m, other=0.0)
    x2 = tl.load(ptrs + HALF, mask=m, other=0.0)
    dt = x1.dtype
    a, b = x1.to(tl.float32), x2.to(tl.float32)
    if NORM:
        nw = tl.where(head < q_heads, qn_ptr, kn_ptr)
        rstd = 1.0 / tl.sqrt((tl.sum(a * a, axis=1) + tl.sum(b * b, axis=1)) / (2 * HALF) + eps)
        w1 = tl.load(nw + rh, mask=h_ok, other=0.0).to(tl.float32)
        w2 = tl.load(nw + HALF + rh, mask=h_ok, other=0.0).to(tl.float32)
        a = (a * rstd[:, None] * w1[None, :]).to(dt).to(tl.float32)
        b = (b * rstd[:, None] * w2[None, :]).to(dt).to(tl.float32)
    c = tl.load(cos_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    s = tl.load(sin_ptr + pos[:, None] * HALF + rh[None, :], mask=m, other=0.0)
    # explicit fmas: the Gluon epilogue (gluon_rope.py) computes the same two, so the rows are bitwise equal
    tl.store(ptrs, tl.fma(a, c, -(b * s)).to(dt), mask=m)
    tl.store(ptrs + HALF, tl.fma(b, c, a * s).to(dt), mask=m)


def rope_cols(y: torch.Tensor, rope: RopeCols) -> torch.Tensor:
    """Launcher; same semantics as reference.rope_cols (in place, returns y). Positions must lie inside the
    cos/sin tables (the caller sizes them: Decoder.rope_tables)."""
    T, D = y.shape[0], rope.head_dim
    if y.dim() != 2 or y.shape[1] < rope.cols or y.stride(1) != 1:
        raise ValueError(f"y {tuple(y.shape)} does not hold {rope.cols} rope columns contiguously")
    if rope.positions.shape != (T,):
        raise ValueError(f"rope positions {tuple(rope.positions.shape)} do not match y's {T} rows")
    if T == 0 or rope.cols == 0:
        return y
    cfg = rope_tiles(y.device.type == "cpu")
    # the kernel selects between the two weights, so both need one pointer type (absent ones are never read)
    kn = rope.k_norm if rope.normed else rope.cos
    qn = rope.q_norm if rope.normed else rope.cos
    _rope_kernel[(triton.cdiv(T, cfg["BM"]), rope.cols // D)](
        y, rope.positions, rope.cos, rope.sin, qn, kn, T, rope.q_cols // D, y.stride(0), rope.eps, HALF=D // 2,
        BM=cfg["BM"], BH=max(16, triton.next_power_of_2(D // 2)), NORM=rope.normed, num_warps=cfg["num_warps"])
    return y
