"""Causal attention over packed variable-length sequences, reading the fused qkv projection directly.

Semantics: reference.varlen_attention — causal softmax(q k^T * scale) v per sequence over q and k already
normed and rotated (the qkv GEMM's RopeCols), GQA, optional sliding window, optional soft-capping of the scores
(cap * tanh(s / cap), gemma2), optional cached prefix rows first, fp32 inside, rounded to qkv's dtype. With
last_only only each sequence's last token queries.

Work list: the grid is (query blocks of all sequences, key/value heads), one program per (sequence, query
block, key/value head), found from cumulative block counts computed on the device. A program owns the block's
queries in every query head of its group (GQA packing), so a key block is read once for the group. The grid
size then depends only on the tensor shapes (T, B), never on a host-side max_seqlen, which is what lets a
CUDA graph captured for a token bucket replay any batch of that size; nor are programs launched for blocks a
short sequence lacks.
Batch invariance: a program walks its sequence's keys in a fixed order, so nothing outside the sequence
changes its result. Long sequences take a larger tile (tuning.attention_long_tile), in a second launch over the
same grid rule: which tile a sequence takes depends on its own key count alone.
Why not a library kernel: PyTorch's FlashAttention-2 varlen forward, batch-invariant too, was slower at W1's
batches (bench/sweep.py attention_lib, docs/performance.md), and it cannot read cached prefix rows in place.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyscan.kernels.fast_math import tanh
from policyscan.kernels.reference import AttnShape, PrefixKV
from policyscan.kernels.tuning import attention_long_tile, attention_tiles


@triton.jit
def _attn_block(q, acc, m_i, l_i, qpos, n0, rows_ptr, pre_ptr, start, P, p0, n_keys, window, qk_scale,
                cap_in, cap_out, stride_t, stride_pre, K_COL, V_COL, kvh, rd, d_ok,
                D: tl.constexpr, HAS_PREFIX: tl.constexpr, MASK: tl.constexpr, BN: tl.constexpr,
                PREC: tl.constexpr, SOFTCAP: tl.constexpr, LIB: tl.constexpr):
    """One key block of the online softmax. MASK=False: every key is visible to every query of the block
    (keys before the block's first query), so neither the causal nor the bounds mask is needed.
    SOFTCAP: the scores become cap * tanh(qk * scale / cap) in log2 units (cap_in = scale / cap,
    cap_out = cap * log2 e), and qk_scale is 1."""
    rn = n0 + tl.arange(0, BN)
    rows = rows_ptr + (start + rn - P) * stride_t
    if HAS_PREFIX:
        rows = tl.where(rn < P, pre_ptr + (p0 + rn) * stride_pre, rows)
    if MASK:
        n_ok = rn < n_keys
        kv_m = n_ok[:, None] & d_ok[None, :]
    else:
        kv_m = d_ok[None, :]
    k = tl.load(rows[:, None] + K_COL + kvh * D + rd[None, :], mask=kv_m, other=0.0)
    qk = tl.dot(q, tl.trans(k), input_precision=PREC)
    if SOFTCAP:
        qk = tanh(qk * cap_in, LIB) * cap_out
    if MASK:
        ok = (rn[None, :] <= qpos[:, None]) & n_ok[None, :]
        if window > 0:
            ok = ok & (rn[None, :] > qpos[:, None] - window)
        m_blk = tl.max(tl.where(ok, qk, float("-inf")), axis=1)
    else:
        m_blk = tl.max(qk, axis=1)
    # max(qk) * scale, not max(qk * scale): the same bits (rounding is monotone and qk_scale > 0) for one
    # multiply a row instead of one a score (the unmasked loop: 348 -> 326 instructions a thread and key block
    # in SASS for sm_90a; end to end within the noise)
    m_new = tl.maximum(m_i, m_blk * qk_scale)
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    # The same instructions with and without the mask, which is applied after: a key block is masked or not
    # depending on where the query block starts, and that differs between a cached prefix and one computed
    # inline. An explicit fma, since the compiler contracted `s - m` into one only where no select sat
    # between them, and the prefix cache's bitwise tests caught it.
    p = tl.exp2(tl.fma(qk, qk_scale, -m_safe[:, None]))
    if MASK:
        p = tl.where(ok, p, 0.0)
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    v = tl.load(rows[:, None] + V_COL + kvh * D + rd[None, :], mask=kv_m, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
    return acc, m_new, l_i


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71); keys_lo and
# keys_hi bound the key counts of the sequences this launch's tile serves (last_only: the others return at once)
@triton.jit(do_not_specialize=["B", "stride_am", "keys_lo", "keys_hi"])
def _attn_kernel(
    qkv_ptr, o_ptr, cu_ptr, blk_seq_ptr, cu_blk_ptr, pre_ptr, pre_start_ptr, pre_len_ptr, amax_ptr,
    scale, window, B, stride_t, stride_ot, stride_pre, K_COL, V_COL, stride_am, cap, keys_lo, keys_hi,
    D: tl.constexpr, LAST_ONLY: tl.constexpr, HAS_PREFIX: tl.constexpr, AMAX: tl.constexpr,
    G: tl.constexpr, BQ: tl.constexpr, QP: tl.constexpr, BR: tl.constexpr,
    BN: tl.constexpr, BD: tl.constexpr, PREC: tl.constexpr, SOFTCAP: tl.constexpr, LIB: tl.constexpr,
):
    pid, kvh = tl.program_id(0), tl.program_id(1)
    if LAST_ONLY:
        b = pid
        mblk = 0
    else:
        b = tl.load(blk_seq_ptr + pid)
        if b >= B:  # the grid is an upper bound on the number of query blocks
            return
        mblk = pid - tl.load(cu_blk_ptr + b)
    start = tl.load(cu_ptr + b)
    n_own = tl.load(cu_ptr + b + 1) - start
    n_q = tl.minimum(n_own, 1) if LAST_ONLY else n_own
    rd = tl.arange(0, BD)
    d_ok = rd < D
    # Row r of the tile is query r // G of the block in head kvh * G + r % G: the G query heads that share
    # this program's key/value head read each key block once. Only the rows past BQ * G are dead (G = 3:
    # 63 of 64 rows live, where rounding G up to 4 heads left a quarter of every MMA dead).
    r = tl.arange(0, BR)
    qi = r // G
    h = kvh * G + r % G
    live = r < BQ * G
    P = 0
    p0 = 0
    if HAS_PREFIX:
        P = tl.load(pre_len_ptr + b)
        p0 = tl.load(pre_start_ptr + b)
    if LAST_ONLY:
        if (P + n_own < keys_lo) | (P + n_own >= keys_hi):  # another launch's tile serves this sequence
            return
        if n_own == 0:  # an empty (padding) sequence still owns its output row
            tl.store(o_ptr + b * stride_ot + h[:, None] * D + rd[None, :],
                     tl.zeros((BR, BD), dtype=o_ptr.dtype.element_ty), mask=live[:, None] & d_ok[None, :])
            if AMAX:
                tl.store(amax_ptr + kvh * stride_am + b, 0.0)
            return
    # Keys are enumerated as one sequence, cached prefix first, in the same BN blocks as when the prefix is
    # computed inline: the reduction order, and so every bit of the result, is the same either way.
    n_keys = P + n_own
    m_ok = live & (mblk * BQ + qi < n_q)
    q0 = n_keys - n_q + mblk * BQ  # position of the block's first query, prefix included
    qpos = q0 + qi
    q_rows = qkv_ptr + (start + qpos - P) * stride_t + h * D
    q = tl.load(q_rows[:, None] + rd[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    m_i = tl.full((BR,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BR,), dtype=tl.float32)
    acc = tl.zeros((BR, BD), dtype=tl.float32)
    qk_scale = scale * 1.4426950408889634  # exp2 instead of exp
    cap_in = scale / cap
    cap_out = cap * 1.4426950408889634
    if SOFTCAP:  # the capped scores come out of _attn_block already scaled
        qk_scale = 1.0
    hi = tl.minimum(n_keys, q0 + BQ)
    # Keys [lo, full) come before the block's first query: every query sees them, so those blocks skip the
    # causal mask (the split depends on positions only, so batch invariance and the prefix cache's bitwise
    # promise hold). With a window every block is masked.
    lo = 0
    if window > 0:
        lo = tl.maximum(q0 - window + 1, 0) // BN * BN
        full = lo
    else:
        full = (q0 + 1) // BN * BN
    for n0 in range(lo, full, BN):
        acc, m_i, l_i = _attn_block(q, acc, m_i, l_i, qpos, n0, qkv_ptr, pre_ptr, start, P, p0, n_keys, window,
                                    qk_scale, cap_in, cap_out, stride_t, stride_pre, K_COL, V_COL, kvh, rd, d_ok,
                                    D, HAS_PREFIX, False, BN, PREC, SOFTCAP, LIB)
    for n0 in range(full, hi, BN):
        acc, m_i, l_i = _attn_block(q, acc, m_i, l_i, qpos, n0, qkv_ptr, pre_ptr, start, P, p0, n_keys, window,
                                    qk_scale, cap_in, cap_out, stride_t, stride_pre, K_COL, V_COL, kvh, rd, d_ok,
                                    D, HAS_PREFIX, True, BN, PREC, SOFTCAP, LIB)
    inv = 1.0 / tl.where(l_i > 0, l_i, 1.0)
    orow = b + qi if LAST_ONLY else start + mblk * BQ + qi  # last_only: row b holds sequence b
    o = (acc * inv[:, None]).to(o_ptr.dtype.element_ty)
    tl.store(o_ptr + orow[:, None] * stride_ot + h[:, None] * D + rd[None, :], o, mask=m_ok[:, None] & d_ok[None, :])
    if AMAX:  # each query's max |o| over the group's heads: partial kvh of the o projection's quantizer
        row_max = tl.where(m_ok, tl.max(tl.where(d_ok[None, :], tl.abs(o.to(tl.float32)), 0.0), axis=1), 0.0)
        qv = tl.arange(0, QP)  # QP: BQ rounded up to a power of two
        q_max = tl.max(tl.where(qi[None, :] == qv[:, None], row_max[None, :], 0.0), axis=1)
        q_ok = (qv < BQ) & (mblk * BQ + qv < n_q)
        tl.store(amax_ptr + kvh * stride_am + (b + qv if LAST_ONLY else start + mblk * BQ + qv), q_max, mask=q_ok)


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, shape: AttnShape, scale: float,
                     window: int | None = None, last_only: bool = False, prefix: PrefixKV | None = None,
                     out: torch.Tensor | None = None, config: dict | None = None,
                     row_amax: bool = False, softcap: float | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launcher; same semantics as reference.varlen_attention. qkv [T, (H + 2 Hkv) D]; `out` [Tq, H D] is
    written in place when given; `config` (BQ queries a program, BN, num_warps, num_stages, maxnreg) is then the
    one tile for every length instead of tuning's two (bench/sweep.py); row_amax: also return each row's max |out|
    per key/value head group [Hkv, Tq], which the o projection's FP8 prologue reads instead of sweeping out
    (prologue's x_amax)."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    T = qkv.shape[0]
    if qkv.dim() != 2 or qkv.shape[1] != (H + 2 * Hkv) * D or qkv.stride(1) != 1:
        raise ValueError(f"qkv {tuple(qkv.shape)} does not hold {H}+2x{Hkv} heads of {D} contiguously")
    B = cu_seqlens.numel() - 1
    if not scale > 0:  # the kernel takes each block's max score before scaling it (_attn_block)
        raise ValueError(f"scale must be positive, got {scale}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive, got {softcap}")
    if cu_seqlens.dtype != torch.int32:
        raise ValueError("cu_seqlens must be int32 [B+1]")
    if prefix is not None:
        if prefix.rows.shape[1] != qkv.shape[1] or prefix.rows.dtype != qkv.dtype or prefix.rows.stride(1) != 1:
            raise ValueError(f"prefix rows {tuple(prefix.rows.shape)} {prefix.rows.dtype} do not match qkv")
        if prefix.start.dtype != torch.int32 or prefix.length.dtype != torch.int32 or prefix.start.numel() != B:
            raise ValueError("prefix start/length must be int32 [B]")
    rows = B if last_only else T
    if out is None:
        out = torch.empty((rows, H * D), dtype=qkv.dtype, device=qkv.device)
    elif out.shape != (rows, H * D) or out.dtype != qkv.dtype or out.stride(1) != 1:
        raise ValueError(f"out must be [{rows}, {H * D}] {qkv.dtype}")
    amax = torch.empty((Hkv, rows), dtype=torch.float32, device=qkv.device) if row_amax else None
    if B == 0:
        return (out, amax) if row_amax else out
    interpret = qkv.device.type == "cpu"
    G = H // Hkv
    tiers = [(0, 2**31 - 1, {**attention_tiles(G, D, interpret), **(config or {})})]
    long = None if config else attention_long_tile(G, D, interpret)
    if long is not None:
        # last_only: one query a sequence, 16 rows, so the long tile's key block on the short tile's warps
        wide = {**tiers[0][2], "BN": long[1]["BN"]} if last_only else long[1]
        tiers = [(0, long[0], tiers[0][2]), (long[0], 2**31 - 1, wide)]
    keys = cu_seqlens[1:] - cu_seqlens[:-1]
    if prefix is not None:
        keys = keys + prefix.length
    for lo, hi, cfg in tiers:  # one launch a tile, over the sequences whose key counts lie in [lo, hi)
        BQ, BN = (1 if last_only else cfg["BQ"]), cfg["BN"]  # last_only: one query per sequence
        if last_only:
            grid, blk_seq, cu_blk = (B, Hkv), cu_seqlens, cu_seqlens
        else:
            # query blocks per sequence, on the device (no sync): sum over b of cdiv(len_b, BQ) <= cdiv(T, BQ) + B;
            # none for a sequence another launch's tile serves
            n_blk = (cu_seqlens[1:] - cu_seqlens[:-1] + BQ - 1) // BQ
            if len(tiers) > 1:
                n_blk = n_blk * ((keys >= lo) & (keys < hi))
            cu_blk = torch.zeros(B + 1, dtype=torch.int32, device=qkv.device)
            cu_blk[1:] = torch.cumsum(n_blk, 0)
            bound = triton.cdiv(T, BQ) + B
            blk_seq = torch.searchsorted(cu_blk, torch.arange(bound, dtype=torch.int32, device=qkv.device),
                                         right=True, out_int32=True) - 1
            grid = (bound, Hkv)
        _attn_kernel[grid](
            qkv, out, cu_seqlens, blk_seq, cu_blk,
            prefix.rows if prefix is not None else qkv, prefix.start if prefix is not None else cu_seqlens,
            prefix.length if prefix is not None else cu_seqlens, amax if row_amax else out,
            scale, window or 0, B, qkv.stride(0), out.stride(0),
            prefix.rows.stride(0) if prefix is not None else 0, H * D, (H + Hkv) * D, rows, softcap or 1.0, lo, hi,
            D=D, LAST_ONLY=last_only, HAS_PREFIX=prefix is not None, AMAX=row_amax, G=G, BQ=BQ,
            QP=triton.next_power_of_2(BQ), BR=max(16, triton.next_power_of_2(BQ * G)), BN=BN,
            BD=max(16, triton.next_power_of_2(D)), PREC="ieee" if qkv.dtype == torch.float32 else "tf32",
            SOFTCAP=softcap is not None, LIB=not interpret,
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
            **({"maxnreg": cfg["maxnreg"]} if cfg.get("maxnreg") else {}))
    return (out, amax) if row_amax else out
