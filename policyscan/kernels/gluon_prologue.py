"""TMA-fed, warp-specialized FP8 prologue (Hopper, Gluon): per-token quantization (RMSNorm folded) + LoRA shrink.

Semantics: prologue.prologue with quant=True and x_amax given (reference.prologue): u = x * w (or x), scale =
max(amax / 448, 2^-126) (1 for a zero row) from the writer's partial row maxima, h8 = e4m3(u * rcp(scale)),
rstd = 1 / sqrt(mean(x^2) + eps) (1 without a norm), h_scale = scale * rstd, s = rstd * x @ A[adapter].T in fp32
(zeros for adapter -1; A carries the norm's weight, layers.Fp8LoraLinear).

How: a loader warp streams x (and the row block's adapter's A) by TMA through a ring of 64-column boxes (64 bf16
are 128 bytes, the widest swizzle), well ahead of use; one warpgroup reads each box from shared memory once for
the quantization while the shrink's bf16 wgmma reads the same box, and h8 leaves by TMA stores. Programs are
persistent (two an SM), so the loader runs into the next row block while the last one's stores drain. A block
holding several adapters sweeps again for each (from L2), only the first sweep quantizing.
Speed: faster than the Triton kernel at every projection, one pass over x and h8 at about the rate of torch's
own bf16 -> e4m3 cast (docs/performance.md).
Where it runs: only where the caller asks (model.py: qkv's prologue). At the GPU's power cap a memory-bound
kernel is judged by the kernel after it: the GEMM right after this prologue ran slower (the HBM burst's power
spike cuts the clock; idle time between the two gave most of it back), so on every projection it lost end to
end, and on qkv's alone it gains (docs/performance.md).

Rows: h8 is bitwise the Triton kernel's (the same fp32 products, the same rounding); the norm's sum of squares and
the shrink are reduced in another order (per 64-column box, the MMA chained over a stage), so h_scale and s may
differ from it in the last bits (3.4e-7 relative, 1e-5 absolute). Which kernel runs depends on the call
site, K, the rank and the dtypes, never on the number of rows (`usable`), so rows stay independent of the batch.
CPU: Gluon has no interpreter; the Triton kernel (prologue.py) runs there.
"""
from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from policyscan.kernels.fast_math import rcp
from policyscan.kernels.gluon_hopper import tma_load, tma_store
from policyscan.kernels.launch import sm_count, tma_ok
from policyscan.kernels.tuning import GP_BKS, GP_BM, GP_BP, GP_MAXNREG, GP_PROGRAMS_PER_SM, GP_STAGES, GP_SUB, GP_WARPS


@gluon.jit
def _adapters(ad_ptr, off_m, M, BM: gl.constexpr, layout: gl.constexpr):
    """The block's adapter ids and the first one present (-1 if none); rows are sorted by adapter."""
    rm = off_m + gl.arange(0, BM, layout=layout)
    ad = gl.load(ad_ptr + rm, mask=rm < M, other=-1)
    lo = gl.min(gl.where(ad >= 0, ad, 2147483647), axis=0)
    first = gl.where(gl.max(ad, axis=0) >= 0, lo, -1)
    return ad, first


@gluon.jit
def _next(ad, a):
    """The next adapter id present after a, or a sentinel past every id: a stack of hundreds with a few in the
    block is not walked id by id (as gluon_expand)."""
    return gl.min(gl.where(ad > a, ad, 2147483647), axis=0)


@gluon.jit
def _load(args, flags):
    """Loader warp: every block's x boxes (and its adapters' A boxes: one sweep per adapter present, the first
    also quantizes) into the stage ring, in the order the warpgroup consumes them."""
    (x_desc, a_desc, h_desc, x_bufs, a_bufs, o_bufs, ready, empty, nw_ptr, ad_ptr, amax_ptr, hs_ptr, s_ptr,
     M, K, R, P, eps, stride_ap, stride_sm) = args
    HAS_LORA: gl.constexpr = flags[1]
    NUM_PROGS: gl.constexpr = flags[2]
    SUB: gl.constexpr = flags[3]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BKS: gl.constexpr = x_desc.block_type.shape[1]
    S: gl.constexpr = x_bufs.type.shape[0] // SUB
    ad_layout: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])
    nk = gl.cdiv(K, SUB * BKS)
    pos = 0
    for blk in range(gl.program_id(0), gl.cdiv(M, BM), NUM_PROGS):
        ad, a = _adapters(ad_ptr, blk * BM, M, BM, ad_layout)
        last = gl.max(ad, axis=0)
        if not HAS_LORA:  # one sweep, no A
            a = -1
            last = -1
        while a <= last:
            for kk in range(nk):
                s = pos % S
                mbarrier.wait(empty.index(s), ((pos // S) & 1) ^ 1)
                if a >= 0:
                    mbarrier.expect(ready.index(s), SUB * (x_desc.block_type.nbytes + a_desc.block_type.nbytes))
                    for j in gl.static_range(SUB):
                        tma_load(x_desc, [blk * BM, (kk * SUB + j) * BKS], ready.index(s), x_bufs.index(s * SUB + j))
                        tma_load(a_desc, [a * R, (kk * SUB + j) * BKS], ready.index(s), a_bufs.index(s * SUB + j))
                else:
                    mbarrier.expect(ready.index(s), SUB * x_desc.block_type.nbytes)
                    for j in gl.static_range(SUB):
                        tma_load(x_desc, [blk * BM, (kk * SUB + j) * BKS], ready.index(s), x_bufs.index(s * SUB + j))
                pos += 1
            a = _next(ad, a)


@gluon.jit
def _compute(args, flags):
    """The warpgroup: each block's scale from the partial maxima, then per stage the shrink's MMAs (async) and,
    in the block's first sweep, the quantization of the same boxes into h8's output boxes."""
    (x_desc, a_desc, h_desc, x_bufs, a_bufs, o_bufs, ready, empty, nw_ptr, ad_ptr, amax_ptr, hs_ptr, s_ptr,
     M, K, R, P, eps, stride_ap, stride_sm) = args
    NORM: gl.constexpr = flags[0]
    HAS_LORA: gl.constexpr = flags[1]
    NUM_PROGS: gl.constexpr = flags[2]
    SUB: gl.constexpr = flags[3]
    BP: gl.constexpr = flags[4]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BKS: gl.constexpr = x_desc.block_type.shape[1]
    BR: gl.constexpr = a_bufs.type.shape[1]
    S: gl.constexpr = x_bufs.type.shape[0] // SUB
    # 8 bf16 (16 bytes) a thread, 8 threads across a box's 64 columns: one swizzled 128-byte row a phase
    xl: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    rows: gl.constexpr = gl.SliceLayout(1, xl)
    cols: gl.constexpr = gl.SliceLayout(0, xl)
    pl: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [1, 4], [1, 0])
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BR, 16])
    mrows: gl.constexpr = gl.SliceLayout(1, mma)
    nk = gl.cdiv(K, SUB * BKS)
    pos = 0
    ob = 0
    for blk in range(gl.program_id(0), gl.cdiv(M, BM), NUM_PROGS):
        off_m = blk * BM
        # FP8 scale: amax |u| from the writer's partial maxima (exact), as prologue.py
        pm = off_m + gl.arange(0, BM, layout=gl.SliceLayout(0, pl))
        mx = gl.zeros([BM], gl.float32, gl.SliceLayout(0, pl))
        for p0 in range(0, P, BP):
            rp = p0 + gl.arange(0, BP, layout=gl.SliceLayout(1, pl))
            part = gl.load(amax_ptr + rp[:, None] * stride_ap + pm[None, :], mask=(rp < P)[:, None] & (pm < M)[None, :],
                           other=0.0)
            mx = gl.maximum(mx, gl.max(part, axis=0))
        scale = gl.where(mx > 0, gl.maximum(mx / 448.0, 1.1754943508222875e-38), 1.0)
        inv = gl.convert_layout(rcp(scale), rows)
        ss = gl.zeros([BM], gl.float32, rows)
        sacc = gl.zeros([BM, BR], gl.float32, mma)
        ad, a = _adapters(ad_ptr, off_m, M, BM, mrows)
        last = gl.max(ad, axis=0)
        if not HAS_LORA:
            a = -1
            last = -1
        quant = 1
        while a <= last:
            for kk in range(nk):
                s = pos % S
                mbarrier.wait(ready.index(s), (pos // S) & 1)
                part = gl.zeros([BM, BR], gl.float32, mma)
                if HAS_LORA:  # in a block without adapters (a = -1) the A boxes are stale: masked below
                    for j in gl.static_range(SUB):
                        part = warpgroup_mma(x_bufs.index(s * SUB + j), a_bufs.index(s * SUB + j).permute((1, 0)),
                                             part, is_async=True)
                if quant:
                    # half ob % 2 of the output boxes: its stores of two stages ago have read them
                    tma.store_wait(SUB)
                    for j in gl.static_range(SUB):
                        xv = x_bufs.index(s * SUB + j).load(xl).to(gl.float32)
                        u = xv
                        if NORM:
                            ss += gl.sum(xv * xv, axis=1)
                            rk = (kk * SUB + j) * BKS + gl.arange(0, BKS, layout=cols)
                            u = xv * gl.load(nw_ptr + rk, mask=rk < K, other=0.0).to(gl.float32)[None, :]
                        # e4m3's conversion saturates at +-448 (cvt.rn.satfinite): no clamp, as prologue.py
                        o_bufs.index((ob % 2) * SUB + j).store((u * inv[:, None]).to(h_desc.dtype))
                    fence_async_shared()
                    for j in gl.static_range(SUB):
                        tma_store(h_desc, [off_m, (kk * SUB + j) * BKS], o_bufs.index((ob % 2) * SUB + j))
                    ob += 1
                if HAS_LORA:
                    part = warpgroup_mma_wait(0, deps=(part, ))
                    sacc += gl.where(((ad == a) & (a >= 0))[:, None], part, 0.0)
                mbarrier.arrive(empty.index(s), count=1)
                pos += 1
            quant = 0
            a = _next(ad, a)
        rstd = gl.full([BM], 1.0, gl.float32, rows)
        if NORM:  # rmsnorm(x) * w = rstd * u: rstd goes into the row scale and the shrink
            rstd = 1.0 / gl.sqrt(ss / K + eps)
        rm = off_m + gl.arange(0, BM, layout=rows)
        gl.store(hs_ptr + rm, gl.convert_layout(scale, rows) * rstd, mask=rm < M)
        if HAS_LORA:
            sm = off_m + gl.arange(0, BM, layout=mrows)
            rr = gl.arange(0, BR, layout=gl.SliceLayout(0, mma))
            sv = sacc * gl.convert_layout(rstd, mrows)[:, None]
            gl.store(s_ptr + sm[:, None] * stride_sm + rr[None, :], sv, mask=(sm < M)[:, None] & (rr < R)[None, :])
    tma.store_wait(0)


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@gluon.jit(do_not_specialize=["M", "stride_ap"])
def _prologue_ws_kernel(x_desc, a_desc, h_desc, nw_ptr, ad_ptr, amax_ptr, hs_ptr, s_ptr, M, K, R, P, eps,
                        stride_ap, stride_sm, NORM: gl.constexpr, HAS_LORA: gl.constexpr, NUM_PROGS: gl.constexpr,
                        SUB: gl.constexpr, STAGES: gl.constexpr, BP: gl.constexpr):
    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES * SUB] + x_desc.block_type.shape, x_desc.layout)
    a_bufs = gl.allocate_shared_memory(a_desc.dtype, [STAGES * SUB] + a_desc.block_type.shape, a_desc.layout)
    o_bufs = gl.allocate_shared_memory(h_desc.dtype, [2 * SUB] + h_desc.block_type.shape, h_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    args = (x_desc, a_desc, h_desc, x_bufs, a_bufs, o_bufs, ready, empty, nw_ptr, ad_ptr, amax_ptr, hs_ptr, s_ptr,
            M, K, R, P, eps, stride_ap, stride_sm)
    # the flags written out in the calls: a tuple assigned to a local turns constexprs into runtime values
    gl.warp_specialize([
        (_compute, (args, (NORM, HAS_LORA, NUM_PROGS, SUB, BP))),
        (_load, (args, (NORM, HAS_LORA, NUM_PROGS, SUB, BP))),
    ], [1], [48])


def _layout(rows: int, cols: int, dtype: gl.dtype) -> gl.NVMMASharedLayout:
    return gl.NVMMASharedLayout.get_default_for([rows, cols], dtype)


def usable(x: torch.Tensor, A: torch.Tensor | None, h: torch.Tensor) -> bool:
    """Whether prologue_ws takes a quantizing call: bf16 x on a Hopper GPU, TMA-able x, h8 and A (rows of 16
    bytes: K a multiple of 16), stacked ranks up to 64 (the shrink's B box). Depends on K, the rank and the
    dtypes, never on M."""
    return (x.is_cuda and x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] == 9
            and h.dtype == torch.float8_e4m3fn and x.shape[1] % 16 == 0 and tma_ok(x, h)
            and (A is None or (A.dtype == torch.bfloat16 and A.shape[1] <= 64 and A.is_contiguous()
                               and tma_ok(A.view(-1, A.shape[2])))))


def prologue_ws(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, A: torch.Tensor | None,
                token_adapter: torch.Tensor, x_amax: torch.Tensor, h: torch.Tensor, hs: torch.Tensor,
                s: torch.Tensor | None, sub: int = GP_SUB, stages: int = GP_STAGES,
                programs_per_sm: int = GP_PROGRAMS_PER_SM) -> None:
    """Launcher; prologue.prologue has checked the arguments and `usable`. Writes h [M, K] e4m3, hs [M] and
    s [M, R]. sub (64-column boxes a stage), stages and programs_per_sm override tuning.GP_* for sweeps."""
    M, K = x.shape
    R = A.shape[1] if A is not None else 0
    BR = max(16, triton.next_power_of_2(max(R, 1)))
    xd = TensorDescriptor.from_tensor(x, [GP_BM, GP_BKS], _layout(GP_BM, GP_BKS, gl.bfloat16))
    hd = TensorDescriptor.from_tensor(h, [GP_BM, GP_BKS], _layout(GP_BM, GP_BKS, gl.float8e4nv))
    a2 = A.view(-1, K) if A is not None else x
    ad = TensorDescriptor.from_tensor(a2, [BR, GP_BKS], _layout(BR, GP_BKS, gl.bfloat16))
    progs = sm_count(x.device) * programs_per_sm
    _prologue_ws_kernel[(min(triton.cdiv(M, GP_BM), progs),)](
        xd, ad, hd, norm_weight if norm_weight is not None else x, token_adapter, x_amax, hs,
        s if s is not None else hs, M, K, R, x_amax.shape[0], eps, x_amax.stride(0),
        s.stride(0) if s is not None else 0,
        NORM=norm_weight is not None, HAS_LORA=A is not None, NUM_PROGS=progs, SUB=sub, STAGES=stages, BP=GP_BP,
        num_warps=GP_WARPS, **({"maxnreg": GP_MAXNREG} if programs_per_sm > 1 else {}))
