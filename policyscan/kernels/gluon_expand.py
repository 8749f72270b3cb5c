"""The multi-LoRA expand of one output tile in the Gluon GEMM's epilogue (lora_gemm_ws.py).

Semantics: acc + s[rows of adapter a] @ B[a].T over the adapters a present in the tile's rows, through ranks
[r_lo, r_hi): all R, or the tile's span (kernels/spans.py: B is zero outside it) — reference.lora_gemm's expand.
One bf16 MMA per adapter through B's slice in shared memory (l_smem), past 64 ranks in 64-rank pieces
(several times faster than the Triton kernel there), and through each tile's rank span when given (spans.py;
docs/performance.md). The MMAs are the Triton kernel's k16 instructions in its order, so the rows are
bitwise that kernel's.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma


@gluon.jit
def expand_tile(acc, l_smem, off_m, off_n, pid_n, M, N, R, s_ptr, b_ptr, ad_ptr, span_ptr, stride_sm, stride_bn_a,
                stride_bn, HAS_SPAN: gl.constexpr, WIDE: gl.constexpr, RK: gl.constexpr):
    """acc [BM, BN] fp32 in the bf16 MMA's layout; l_smem [BN, BR] this consumer's B slice buffer; RK the ranks a
    tile expands (the span width, or R padded); WIDE: R padded past 64, in pieces of BR = 64."""
    BM: gl.constexpr = acc.type.shape[0]
    BN: gl.constexpr = acc.type.shape[1]
    BR: gl.constexpr = l_smem.type.shape[1]
    s_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc.type.layout, k_width=2)
    b_layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    # ranks [r_lo, r_hi) of s and B: all of them, or the tile's span (spans.py: B is zero outside it)
    r_lo = 0
    r_hi = R
    sm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, s_layout))
    ad_s = gl.load(ad_ptr + sm, mask=sm < M, other=-1)
    lo = gl.min(gl.where(ad_s >= 0, ad_s, 2147483647), axis=0)
    hi = gl.max(ad_s, axis=0)
    if HAS_SPAN:
        span = gl.load(span_ptr + pid_n)
        r_lo = gl.maximum(span, 0)
        r_hi = gl.where(span >= 0, gl.minimum(span + RK, R), 0)
        hi = gl.where(span >= 0, hi, -1)  # no adapter has ranks on these columns: no expand
    sr = r_lo + gl.arange(0, BR, layout=gl.SliceLayout(0, s_layout))
    if not WIDE:
        sv = gl.load(s_ptr + sm[:, None] * stride_sm + sr[None, :],
                     mask=(sm < M)[:, None] & (sr < r_hi)[None, :], other=0.0)
    bn = off_n + gl.arange(0, BN, layout=gl.SliceLayout(1, b_layout))
    br = r_lo + gl.arange(0, BR, layout=gl.SliceLayout(0, b_layout))
    # rows are sorted by adapter, so a tile usually holds one; a tile across a boundary masks rows.
    # Only the adapters present: a stack of hundreds with a few in the batch leaves gaps of absent ids
    # between them, which a visit of each id from lo to hi paid for many times over; with a few adapters the
    # two cost the same (docs/performance.md)
    a_id = lo
    while a_id <= hi:
        if WIDE:  # ranks past 64 in 64-rank pieces through the one B slice buffer: the same k16 MMAs in
            # the same order as one wide MMA, so the rows stay bitwise the Triton kernel's
            for r0 in range(0, r_hi - r_lo, BR):
                sv = gl.load(s_ptr + sm[:, None] * stride_sm + (r0 + sr)[None, :],
                             mask=(sm < M)[:, None] & ((r0 + sr) < r_hi)[None, :], other=0.0)
                bt = gl.load(b_ptr + a_id * stride_bn_a + bn[:, None] * stride_bn + (r0 + br)[None, :],
                             mask=(bn < N)[:, None] & ((r0 + br) < r_hi)[None, :], other=0.0)
                l_smem.store(bt)
                fence_async_shared()
                a_op = gl.where((ad_s == a_id)[:, None], sv, 0.0).to(b_ptr.dtype.element_ty)
                acc = warpgroup_mma(a_op, l_smem.permute((1, 0)), acc)
        else:
            bt = gl.load(b_ptr + a_id * stride_bn_a + bn[:, None] * stride_bn + br[None, :],
                         mask=(bn < N)[:, None] & (br < r_hi)[None, :], other=0.0)
            l_smem.store(bt)
            fence_async_shared()
            a_op = gl.where((ad_s == a_id)[:, None], sv, 0.0).to(b_ptr.dtype.element_ty)
            acc = warpgroup_mma(a_op, l_smem.permute((1, 0)), acc)
        a_id = gl.min(gl.where(ad_s > a_id, ad_s, 2147483647), axis=0)
    return acc
