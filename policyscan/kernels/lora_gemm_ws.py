"""Warp-specialized ping-pong FP8 or bf16 GEMM + multi-LoRA expand (+ bias, + residual) (+ SiLU-and-mul), Hopper.

Semantics: y = (x @ W.T) (* (x_scale[:, None] * w_scale[None, :]), FP8 only) + s.to(B.dtype) @ B[token_adapter].T
(+ bias) (+ residual), fp32 accumulation, one rounding to y's dtype; with silu_out, W's rows alternate
gate and up and y = silu(y[:, 0::2]) * y[:, 1::2]; with amax, amax[n, m] = max |y[m] (* amax_weight)| over
tile n's columns — reference.lora_gemm, as kernels.lora_gemm.

Why: in the Triton persistent kernel (lora_gemm.py) a tile's epilogue runs while the tensor cores idle (Triton
3.6's automatic warp specialization did not change that). Here, as in CUTLASS's ping-pong schedule, a
loader warp streams operands by TMA through a ring of shared-memory stages and two consumer warpgroups take
alternate 128x128 tiles (a 128x128 fp32 accumulator is 128 registers a thread): while one runs a tile's MMAs,
the other runs the previous tile's epilogue. The residual arrives by TMA during the mainloop and the output
leaves by TMA (pointer tiles spilled 744-904 bytes a thread). The multi-LoRA expand is gluon_expand.py's, the
SiLU-and-mul fast_math.py's (the Triton kernel's instructions, so the same bits), the rope gluon_rope.py's.
At 16k rows it is faster than the Triton kernel and torch._scaled_mm at each of W1's four projections, with 4
stages (5 fit only at gate_up, and were slower there). bf16 runs the same schedule with 64-wide K steps (a stage
is 32 KB either way), as the Triton kernel's bf16 BK, so that both give the same rows. Cooperative 128x256 tiles (two m64n256 consumers sharing W
tiles, as DeepGEMM) gave the same rows at about this speed and nothing end to end (docs/performance.md).
Batch invariance: BK is fixed and one warpgroup reduces K in order, with the Triton kernel's MMA instructions in
its order: the rows are bitwise that kernel's (test_gemm_kernels_agree_bitwise), so lora_gemm picks by M.
CPU: Gluon has no interpreter; the same semantics run in lora_gemm.py's Triton kernel under TRITON_INTERPRET=1.
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

from policyscan.kernels.fast_math import bf16_to_f32, silu_mul, to_bf16
from policyscan.kernels.gluon_expand import expand_tile
from policyscan.kernels.gluon_hopper import smem_layout, tma_load, tma_store
from policyscan.kernels.gluon_rope import rope_regs
from policyscan.kernels.launch import sm_count, tma_ok
from policyscan.kernels.reference import RopeCols
from policyscan.kernels.spans import RankSpans
from policyscan.kernels.tuning import WS_BM, WS_BN, WS_MAXNREG, WS_STAGES, WS_WARPS, ws_bk, ws_group_m


@gluon.jit
def _tile(tile, M, N, BM: gl.constexpr, BN: gl.constexpr, GROUP_M: gl.constexpr):
    """Grouped tile order (as lora_gemm._tile): neighbouring tiles share W tiles in L2."""
    num_m = gl.cdiv(M, BM)
    num_n = gl.cdiv(N, BN)
    group = tile // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = min(num_m - first_m, GROUP_M)
    return first_m + (tile % (GROUP_M * num_n)) % size_m, (tile % (GROUP_M * num_n)) // size_m


@gluon.jit
def _load(args, flags):
    """Loader warp: x and W tiles of every tile of this program, in order, into the stage ring."""
    (x_desc, w_desc, y_desc, r_desc, a_bufs, b_bufs, c_bufs, l_bufs, ready, empty, order, res_bar,
     xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, amax_ptr, amax_w_ptr, span_ptr, pos_ptr, cs_ptr,
     rope_cols, M, N, K, R, stride_sm, stride_bn_a, stride_bn) = args
    GROUP_M: gl.constexpr = flags[4]
    NUM_PROGS: gl.constexpr = flags[5]
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    S: gl.constexpr = a_bufs.type.shape[0]
    nk = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(gl.cdiv(M, BM) * gl.cdiv(N, BN) - pid, NUM_PROGS)
    for i in range(n_tiles):
        pid_m, pid_n = _tile(pid + i * NUM_PROGS, M, N, BM, BN, GROUP_M)
        for kk in range(nk):
            pos = i * nk + kk
            s = pos % S
            mbarrier.wait(empty.index(s), ((pos // S) & 1) ^ 1)
            mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
            tma_load(x_desc, [pid_m * BM, kk * BK], ready.index(s), a_bufs.index(s))
            tma_load(w_desc, [pid_n * BN, kk * BK], ready.index(s), b_bufs.index(s))


@gluon.jit
def _consume(args, flags, ROLE: gl.constexpr):
    """Consumer warpgroup ROLE: the MMAs and the epilogue of this program's tiles ROLE, ROLE + 2, ..."""
    (x_desc, w_desc, y_desc, r_desc, a_bufs, b_bufs, c_bufs, l_bufs, ready, empty, order, res_bar,
     xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, amax_ptr, amax_w_ptr, span_ptr, pos_ptr, cs_ptr,
     rope_cols, M, N, K, R, stride_sm, stride_bn_a, stride_bn) = args
    HAS_LORA: gl.constexpr = flags[0]
    HAS_BIAS: gl.constexpr = flags[1]
    HAS_RES: gl.constexpr = flags[2]
    SILU_OUT: gl.constexpr = flags[3]
    GROUP_M: gl.constexpr = flags[4]
    NUM_PROGS: gl.constexpr = flags[5]
    AMAX: gl.constexpr = flags[6]
    AMAX_W: gl.constexpr = flags[7]
    WIDE: gl.constexpr = flags[8]
    HAS_SPAN: gl.constexpr = flags[9]
    RK: gl.constexpr = flags[10]  # ranks a tile expands: the span width, or R padded
    ROPE_HALF: gl.constexpr = flags[11]  # half a head's width when q and k are rotated here (gluon_rope.py), or 0
    SCALED: gl.constexpr = flags[12]  # FP8 operands with row scales; bf16 has none
    BM: gl.constexpr = x_desc.block_type.shape[0]
    BK: gl.constexpr = x_desc.block_type.shape[1]
    BN: gl.constexpr = w_desc.block_type.shape[0]
    S: gl.constexpr = a_bufs.type.shape[0]
    MMA_K: gl.constexpr = 32 if SCALED else 16  # K of one wgmma instruction: 32 bytes of each operand row
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, MMA_K])
    # the expand's bf16 MMA (k = 16 per instruction); the accumulator's registers are laid out the same
    mma16: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 16])
    rows: gl.constexpr = gl.SliceLayout(1, mma16)
    cols: gl.constexpr = gl.SliceLayout(0, mma16)
    c_smem = c_bufs.index(ROLE)
    l_smem = l_bufs.index(ROLE)
    nk = gl.cdiv(K, BK)
    pid = gl.program_id(0)
    n_tiles = gl.cdiv(gl.cdiv(M, BM) * gl.cdiv(N, BN) - pid, NUM_PROGS)
    for i in range(ROLE, n_tiles, 2):
        pid_m, pid_n = _tile(pid + i * NUM_PROGS, M, N, BM, BN, GROUP_M)
        off_m = pid_m * BM
        off_n = pid_n * BN
        if HAS_RES:
            # the residual tile comes by TMA into the output buffer while the MMAs run
            tma.store_wait(0)
            mbarrier.expect(res_bar.index(ROLE), r_desc.block_type.nbytes)
            tma_load(r_desc, [off_m, off_n], res_bar.index(ROLE), c_smem)
        acc = gl.zeros([BM, BN], gl.float32, mma)
        # Mainloops take turns in tile order: tile i starts once tile i - 1 has passed all its waits on
        # `ready`. Besides the ping-pong itself this keeps the parity waits sound: when a stage is waited
        # for, its previous fill has already been waited for, so the barrier is never two phases behind.
        mbarrier.wait(order.index(ROLE), ((i - 1) // 2) & 1, pred=i > 0)
        for kk in range(nk):
            pos = i * nk + kk
            s = pos % S
            mbarrier.wait(ready.index(s), (pos // S) & 1)
            acc = warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), acc, is_async=True)
            # one MMA in flight: the previous step's is done, so its stage goes back to the loader
            acc = warpgroup_mma_wait(1, deps=(acc, ))
            mbarrier.arrive(empty.index((pos + S - 1) % S), count=1, pred=kk > 0)
        mbarrier.arrive(order.index(1 - ROLE), count=1)
        acc = warpgroup_mma_wait(0, deps=(acc, ))
        mbarrier.arrive(empty.index((i * nk + nk - 1) % S), count=1)

        acc = gl.convert_layout(acc, mma16)
        rm = off_m + gl.arange(0, BM, layout=rows)
        rn = off_n + gl.arange(0, BN, layout=cols)
        m_ok = rm < M
        n_ok = rn < N
        if SCALED:
            xs = gl.load(xs_ptr + rm, mask=m_ok, other=0.0)
            ws = gl.load(ws_ptr + rn, mask=n_ok, other=0.0)
            acc = acc * xs[:, None] * ws[None, :]
        if HAS_LORA:
            acc = expand_tile(acc, l_smem, off_m, off_n, pid_n, M, N, R, s_ptr, b_ptr, ad_ptr, span_ptr, stride_sm,
                              stride_bn_a, stride_bn, HAS_SPAN, WIDE, RK)
        if HAS_BIAS:
            acc += gl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(gl.float32)[None, :]
        if HAS_RES:
            mbarrier.wait(res_bar.index(ROLE), (i // 2) & 1)
            acc += c_smem.load(mma16).to(gl.float32)
        else:
            tma.store_wait(0)
        if SILU_OUT:
            g, u = gl.split(gl.reshape(acc, [BM, BN // 2, 2]))
            acc = silu_mul(g, u, True)
            out_n = pid_n * (BN // 2)
        else:
            out_n = off_n
        if AMAX_W:  # the tile's row maxima of |y * amax_w| as stored; columns past N are TMA's zeros
            out = to_bf16(acc)  # fast_math.py: packed conversions (o's epilogue -128 instructions a thread and tile)
            aw = gl.load(amax_w_ptr + rn, mask=n_ok, other=0.0).to(gl.float32)
            am = gl.max(gl.abs(bf16_to_f32(out) * aw[None, :]), axis=1)
        else:
            if AMAX:  # max |rn(y)| = rn(max |y|): rounding is monotone and odd, so one rounding a row
                am = gl.max(gl.abs(acc), axis=1).to(y_desc.dtype).to(gl.float32)
            out = acc.to(y_desc.dtype)
        if AMAX:
            am_rows = off_m + gl.arange(0, BM, layout=am.type.layout)
            gl.store(amax_ptr + pid_n * M + am_rows, am, mask=am_rows < M)
        if ROPE_HALF > 0:
            if off_n < rope_cols:  # v's tiles load no tables
                out = rope_regs(out, off_m, off_n, M, pos_ptr, cs_ptr, rope_cols, ROPE_HALF)
        c_smem.store(out)
        fence_async_shared()
        tma_store(y_desc, [off_m, out_n], c_smem)
    tma.store_wait(0)


@gluon.jit
def _consume_even(args, flags):
    _consume(args, flags, 0)


@gluon.jit
def _consume_odd(args, flags):
    _consume(args, flags, 1)


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@gluon.jit(do_not_specialize=["M"])
def _lora_gemm_ws_kernel(x_desc, w_desc, y_desc, r_desc, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, amax_ptr,
                         amax_w_ptr, span_ptr, pos_ptr, cs_ptr, rope_cols, M, N, K, R, stride_sm,
                         stride_bn_a, stride_bn, HAS_LORA: gl.constexpr, HAS_SPAN: gl.constexpr,
                         HAS_BIAS: gl.constexpr, HAS_RES: gl.constexpr,
                         SILU_OUT: gl.constexpr, GROUP_M: gl.constexpr, NUM_PROGS: gl.constexpr,
                         AMAX: gl.constexpr, AMAX_W: gl.constexpr, STAGES: gl.constexpr, BR: gl.constexpr,
                         ROPE_HALF: gl.constexpr, SCALED: gl.constexpr):
    BN: gl.constexpr = w_desc.block_type.shape[0]
    a_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    b_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    # per consumer: its output tile (the residual lands there first) and its adapter's B slice
    c_bufs = gl.allocate_shared_memory(y_desc.dtype, [2] + y_desc.block_type.shape, y_desc.layout)
    BRC: gl.constexpr = 64 if BR > 64 else BR
    l_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BRC], gl.bfloat16)
    l_bufs = gl.allocate_shared_memory(gl.bfloat16, [2, BN, BRC], l_layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    order = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    res_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=1)
    for i in gl.static_range(2):
        mbarrier.init(order.index(i), count=1)
        mbarrier.init(res_bar.index(i), count=1)
    args = (x_desc, w_desc, y_desc, r_desc, a_bufs, b_bufs, c_bufs, l_bufs, ready, empty, order, res_bar,
            xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, amax_ptr, amax_w_ptr, span_ptr, pos_ptr, cs_ptr,
            rope_cols, M, N, K, R, stride_sm, stride_bn_a, stride_bn)
    # The flags are written out in the calls: a tuple assigned to a local turns constexprs into runtime values.
    # 12 warps in all (the loader's warp rounds up to a warpgroup): 232 registers for each consumer and
    # 40 for the loader fill the 64K register file at maxnreg=168 (CUTLASS's ping-pong split).
    gl.warp_specialize([
        (_consume_even, (args, (HAS_LORA, HAS_BIAS, HAS_RES, SILU_OUT, GROUP_M, NUM_PROGS, AMAX, AMAX_W, BR > 64,
                                 HAS_SPAN, BR, ROPE_HALF, SCALED))),
        (_consume_odd, (args, (HAS_LORA, HAS_BIAS, HAS_RES, SILU_OUT, GROUP_M, NUM_PROGS, AMAX, AMAX_W, BR > 64,
                                 HAS_SPAN, BR, ROPE_HALF, SCALED))),
        (_load, (args, (HAS_LORA, HAS_BIAS, HAS_RES, SILU_OUT, GROUP_M, NUM_PROGS, AMAX, AMAX_W, BR > 64,
                                 HAS_SPAN, BR, ROPE_HALF, SCALED))),
    ], [4, 1], [232, 40])


def usable(x: torch.Tensor, W: torch.Tensor, y: torch.Tensor, residual: torch.Tensor | None,
           B: torch.Tensor | None) -> bool:
    """Whether lora_gemm_ws takes this call: FP8 or bf16 in, bf16 out on a Hopper GPU, TMA-able operands, bf16 B of
    any rank (past 64 the expand goes in 64-rank pieces: a [128, 64] B slice per consumer is what fits beside the
    stages and output tiles, ~230,000 of the 232,448 bytes of shared memory a block may have)."""
    return (x.is_cuda and x.dtype in (torch.float8_e4m3fn, torch.bfloat16) and W.dtype == x.dtype
            and torch.cuda.get_device_capability(x.device)[0] == 9
            and y.dtype == torch.bfloat16 and (residual is None or residual.dtype == torch.bfloat16)
            and (B is None or B.dtype == torch.bfloat16)
            and tma_ok(*(t for t in (x, W, y, residual) if t is not None)))


def rope_ok(rope: RopeCols) -> bool:
    """Whether the epilogue can rotate these heads (gluon_rope.py): whole heads of 64 or 128 columns in a tile,
    no head norms, packed tables. A Qwen3 norm's row sum would be reduced in another order than the rope pass's,
    so the rows would depend on which kernel ran: such heads take the pass (lora_gemm)."""
    return WS_BN % rope.head_dim == 0 and rope.head_dim >= 64 and not rope.normed and rope.packed is not None


def lora_gemm_ws(x: torch.Tensor, x_scale: torch.Tensor | None, W: torch.Tensor, w_scale: torch.Tensor | None,
                 s: torch.Tensor | None, B: torch.Tensor | None, token_adapter: torch.Tensor,
                 bias: torch.Tensor | None, residual: torch.Tensor | None, y: torch.Tensor,
                 silu_out: bool = False, amax: torch.Tensor | None = None,
                 amax_weight: torch.Tensor | None = None, spans: RankSpans | None = None,
                 rope: RopeCols | None = None, group_m: int | None = None) -> torch.Tensor:
    """Launcher for FP8 x [M, K] and W [N, K] with row scales x_scale [M], w_scale [N] (bf16 x and W without) into
    y; the caller,
    kernels.lora_gemm.lora_gemm, has checked the other arguments and `usable`. amax [cdiv(N, WS_BN), M] fp32,
    when given, receives each tile's row maxima of |y| (of |y * amax_weight| with that [N] weight); spans
    (kernels.spans, for blocks of WS_BN columns) narrows each tile's expand; rope: q and k rotated as they are
    written (`rope_ok`); `group_m` overrides tuning.ws_group_m (bench/sweep.py). Tiles: tuning.WS_*."""
    M, K = x.shape
    N = W.shape[0]
    if amax is not None and (amax.shape != (triton.cdiv(N, WS_BN), M) or amax.dtype != torch.float32
                             or not amax.is_contiguous()):
        raise ValueError(f"amax must be a contiguous fp32 [{triton.cdiv(N, WS_BN)}, {M}]")
    fp8 = x.dtype == torch.float8_e4m3fn
    if not usable(x, W, y, residual, B) or (x_scale is None) == fp8 or (w_scale is None) == fp8:
        raise ValueError("lora_gemm_ws takes FP8 x and W with row scales, or bf16 x and W without, on a Hopper GPU, "
                         "TMA-aligned rows, bf16 B; use kernels.lora_gemm.lora_gemm, which falls back otherwise")
    if rope is not None and not (rope_ok(rope) and not silu_out and amax is None):
        raise ValueError("lora_gemm_ws rotates heads of 64 or 128 columns without norms, from packed tables "
                         "(reference.pack_rope), in a plain epilogue")
    bk = ws_bk(x.dtype)
    xd = TensorDescriptor.from_tensor(x, [WS_BM, bk], smem_layout(WS_BM, bk, fp8))
    wd = TensorDescriptor.from_tensor(W, [WS_BN, bk], smem_layout(WS_BN, bk, fp8))
    y_block = [WS_BM, WS_BN // 2 if silu_out else WS_BN]
    yd = TensorDescriptor.from_tensor(y, y_block, smem_layout(*y_block, False))
    rd = TensorDescriptor.from_tensor(residual, [WS_BM, WS_BN], yd.layout) if residual is not None else yd
    tiles = triton.cdiv(M, WS_BM) * triton.cdiv(N, WS_BN)
    if group_m is None:
        group_m = ws_group_m(N)
    sms = sm_count(x.device)
    R = s.shape[1] if s is not None else 0
    BR = max(16, triton.next_power_of_2(max(R, 1)))  # ranks a tile expands (in 64-rank pieces past 64)
    use_spans = s is not None and spans is not None and spans.cols == WS_BN and spans.width < BR
    if use_spans:
        if spans.start.numel() != triton.cdiv(N, WS_BN) or spans.start.device != x.device:
            raise ValueError(f"spans has {spans.start.numel()} blocks on {spans.start.device}, "
                             f"N = {N} needs {triton.cdiv(N, WS_BN)} on {x.device}")
        BR = spans.width
    f32 = x_scale if fp8 else token_adapter  # where a pointer argument is unused
    _lora_gemm_ws_kernel[(min(tiles, sms),)](
        xd, wd, yd, rd, f32, w_scale if fp8 else f32, s if s is not None else f32, B if B is not None else y,
        token_adapter, bias if bias is not None else y, amax if amax is not None else f32,
        amax_weight if amax_weight is not None else f32, spans.start if use_spans else token_adapter,
        *((rope.positions, rope.packed, rope.cols) if rope is not None else (token_adapter, token_adapter, 0)),
        M, N, K, R,
        s.stride(0) if s is not None else 0, B.stride(0) if B is not None else 0, B.stride(1) if B is not None else 0,
        HAS_LORA=s is not None, HAS_SPAN=use_spans, HAS_BIAS=bias is not None, HAS_RES=residual is not None,
        SILU_OUT=silu_out, GROUP_M=group_m, NUM_PROGS=sms, AMAX=amax is not None, AMAX_W=amax_weight is not None,
        STAGES=WS_STAGES, BR=BR, ROPE_HALF=rope.head_dim // 2 if rope is not None else 0, SCALED=fp8,
        num_warps=WS_WARPS,
        maxnreg=WS_MAXNREG)
    return y
