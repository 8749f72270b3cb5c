"""Fused (FP8 or 16/32-bit) GEMM + multi-LoRA expand (+ bias, + residual) (+ SiLU-and-mul) in one kernel.

Semantics: y = (x @ W.T) * (x_scale[:, None] * w_scale[None, :]) + s.to(B.dtype) @ B[token_adapter].T
(+ bias) (+ residual), fp32 accumulation, one rounding to y's dtype; with silu_out, W's rows alternate
gate and up and y = silu(y[:, 0::2]) * y[:, 1::2] (gelu_tanh with gelu: gemma2) — reference.lora_gemm.

Why SiLU-and-mul here: as the down projection's prologue it re-read the [T, 2I] gate/up output twice
(bench/sweep.py, docs/performance.md); here gate and up sit side by side in the accumulator and only [T, I] is
written.

Why fused: the expand reads s [M, R] and one [BN, R] slice of B per tile; doing it in the epilogue saves
a full read-modify-write of y [M, N] that a separate expand kernel costs.
Batch invariance: no split-K, and BK depends only on the dtype, so K is reduced in one fixed order and
a row's result does not depend on what else is in the batch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from policyscan.kernels.fast_math import gelu_tanh_mul, silu_mul
from policyscan.kernels.launch import sm_count, tma_ok
from policyscan.kernels.reference import RopeCols
from policyscan.kernels.rope import rope_cols
from policyscan.kernels.spans import RankSpans
from policyscan.kernels.tuning import WS_BN, WS_MIN_ROWS, gemm_tiles

try:  # the warp-specialized Hopper FP8 kernel needs Triton's Gluon with its Hopper API (written for Triton 3.6)
    from policyscan.kernels import lora_gemm_ws
except (ImportError, AttributeError):  # another Triton: the Triton kernel below takes every call
    lora_gemm_ws = None


@triton.jit
def _tile(pid, M, N, BM: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Grouped tile order: neighbouring programs share W tiles in L2."""
    num_m, num_n = tl.cdiv(M, BM), tl.cdiv(N, BN)
    group = pid // (GROUP_M * num_n)
    first_m = group * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    return first_m + (pid % (GROUP_M * num_n)) % size_m, (pid % (GROUP_M * num_n)) // size_m


@triton.jit
def _expand(acc, s, mine, b_ptr, rn, rr, n_ok, R, stride_bn, PREC: tl.constexpr):
    """acc + s[mine rows] @ B_a.T for one adapter's B slice at b_ptr ([N, R], columns rn)."""
    bt = tl.load(b_ptr + rn[:, None] * stride_bn + rr[None, :], mask=n_ok[:, None] & (rr[None, :] < R), other=0.0)
    return tl.dot(tl.where(mine[:, None], s, 0.0).to(bt.dtype), tl.trans(bt), acc, input_precision=PREC)


@triton.jit
def _epilogue(acc, rm, rn, M, N, R, y_ptr, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, res_ptr, amax_ptr,
              amax_w_ptr, stride_ym, stride_sm, stride_bn_a, stride_bn, stride_rm, pid_n,
              HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
              SILU_OUT: tl.constexpr, AMAX: tl.constexpr, AMAX_W: tl.constexpr, BM: tl.constexpr,
              BN: tl.constexpr, BR: tl.constexpr, PREC: tl.constexpr):
    """Scales, the multi-LoRA expand, bias, residual, SiLU-and-mul and the store of one [BM, BN] tile
    (with AMAX, also the tile's row maxima of |y * amax_w| (or |y|), y as stored: partial pid_n of amax).
    SILU_OUT: 0 none, 1 the plain formula (interpreter), 2 fast_math's form, the Gluon kernel's bits;
    GELU-tanh-and-mul instead: 3 with the interpreter's tanh, 4 with libdevice's."""
    m_ok, n_ok = rm < M, rn < N
    if HAS_SCALE:
        xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
        acc = acc * xs[:, None] * ws[None, :]
    if HAS_LORA:
        ad = tl.load(ad_ptr + rm, mask=m_ok, other=-1)
        big = 2147483647
        lo = tl.min(tl.where(ad >= 0, ad, big), axis=0)
        hi = tl.max(ad, axis=0)
        rr = tl.arange(0, BR)
        s = tl.load(s_ptr + rm[:, None] * stride_sm + rr[None, :], mask=m_ok[:, None] & (rr[None, :] < R), other=0.0)
        s = s.to(b_ptr.dtype.element_ty)
        # Rows are sorted by adapter, so a tile usually holds one; a tile across a boundary masks rows per adapter.
        # Never software-pipelined: Triton 3.6 pipelined this loop wrongly, rows of tiles across adapters moving
        # run to run (bench/determinism.py trace; docs/performance.md) and, at a stacked rank of 64, far off. A
        # while loop over the present ids only (as gluon_expand) was deterministic
        # end to end but failed two explicit-feed GPU kernel tests (cause not established): a plain range here.
        for a_id in tl.range(lo, hi + 1, num_stages=1):
            acc = _expand(acc, s, ad == a_id, b_ptr + a_id * stride_bn_a, rn, rr, n_ok, R, stride_bn, PREC)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0)[None, :]
    mask = m_ok[:, None] & n_ok[None, :]
    if HAS_RES:
        acc += tl.load(res_ptr + rm[:, None] * stride_rm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    if SILU_OUT:
        g, u = tl.split(tl.reshape(acc, (BM, BN // 2, 2)))
        if SILU_OUT >= 3:
            h = gelu_tanh_mul(g, u, SILU_OUT == 4).to(y_ptr.dtype.element_ty)
        else:
            h = silu_mul(g, u, SILU_OUT == 2).to(y_ptr.dtype.element_ty)
        rh = pid_n * (BN // 2) + tl.arange(0, BN // 2)
        mask = m_ok[:, None] & (rh[None, :] < N // 2)
        tl.store(y_ptr + rm[:, None] * stride_ym + rh[None, :], h, mask=mask)
    else:
        h = acc.to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], h, mask=mask)
    if AMAX:
        v = h.to(tl.float32)
        if AMAX_W:
            v = v * tl.load(amax_w_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(amax_ptr + pid_n * M + rm, tl.max(tl.where(mask, tl.abs(v), 0.0), axis=1), mask=m_ok)


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@triton.jit(do_not_specialize=["M"])
def _lora_gemm_kernel(
    x_ptr, w_ptr, y_ptr, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, res_ptr, amax_ptr, amax_w_ptr,
    M, N, K, R,
    stride_xm, stride_wn, stride_ym, stride_sm, stride_bn_a, stride_bn, stride_rm,
    HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU_OUT: tl.constexpr, AMAX: tl.constexpr, AMAX_W: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr,
):
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BM, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    x_ptrs = x_ptr + rm[:, None] * stride_xm + rk[None, :]
    w_ptrs = w_ptr + rn[:, None] * stride_wn + rk[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BK)):
        k_ok = rk < K - k * BK
        a = tl.load(x_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        acc = tl.dot(a, tl.trans(b), acc, input_precision=PREC)
        x_ptrs += BK
        w_ptrs += BK
    _epilogue(acc, rm, rn, M, N, R, y_ptr, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, res_ptr, amax_ptr,
              amax_w_ptr, stride_ym, stride_sm, stride_bn_a, stride_bn, stride_rm, pid_n,
              HAS_SCALE, HAS_LORA, HAS_BIAS, HAS_RES, SILU_OUT, AMAX, AMAX_W, BM, BN, BR, PREC)


# batch-sized ints unspecialized: one variant for any batch (W1: 32 to compile fresh, not 71)
@triton.jit(do_not_specialize=["M"])
def _lora_gemm_tma_kernel(
    x_desc, w_desc, y_ptr, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, res_ptr, amax_ptr, amax_w_ptr,
    M, N, K, R,
    stride_ym, stride_sm, stride_bn_a, stride_bn, stride_rm,
    HAS_SCALE: tl.constexpr, HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr,
    SILU_OUT: tl.constexpr, AMAX: tl.constexpr, AMAX_W: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr, GROUP_M: tl.constexpr,
    PREC: tl.constexpr, NUM_PROGS: tl.constexpr,
):
    """The same tiles fed by TMA (tensor descriptors; out-of-bounds reads are zeros), each program walking
    tiles pid, pid + NUM_PROGS, ... (persistent when there are more tiles than programs)."""
    num_tiles = tl.cdiv(M, BM) * tl.cdiv(N, BN)
    for tile in tl.range(tl.program_id(0), num_tiles, NUM_PROGS, flatten=True):
        pid_m, pid_n = _tile(tile, M, N, BM, BN, GROUP_M)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BK)):
            a = x_desc.load([pid_m * BM, k * BK])
            b = w_desc.load([pid_n * BN, k * BK])
            acc = tl.dot(a, b.T, acc, input_precision=PREC)
        rm = pid_m * BM + tl.arange(0, BM)
        rn = pid_n * BN + tl.arange(0, BN)
        _epilogue(acc, rm, rn, M, N, R, y_ptr, xs_ptr, ws_ptr, s_ptr, b_ptr, ad_ptr, bias_ptr, res_ptr, amax_ptr,
                  amax_w_ptr, stride_ym, stride_sm, stride_bn_a, stride_bn, stride_rm, pid_n,
                  HAS_SCALE, HAS_LORA, HAS_BIAS, HAS_RES, SILU_OUT, AMAX, AMAX_W, BM, BN, BR, PREC)


def lora_gemm(x: torch.Tensor, x_scale: torch.Tensor | None, W: torch.Tensor, w_scale: torch.Tensor | None,
              s: torch.Tensor | None, B: torch.Tensor | None, token_adapter: torch.Tensor,
              bias: torch.Tensor | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
              silu_out: bool = False, out: torch.Tensor | None = None, config: dict | None = None,
              row_amax: bool = False, amax_weight: torch.Tensor | None = None, spans: RankSpans | None = None,
              rope: RopeCols | None = None, gelu: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Launcher; same semantics as reference.lora_gemm. x [M, K], W [N, K], B [n, N, R]; `out` is written
    in place when given; `config` overrides the Triton kernel's tiles (tuning.gemm_tiles; bench/sweep.py).
    row_amax: also return each tile's row maxima of |y| [N tiles, M] — of |y * amax_weight| when given (the
    next RMSNorm's weight) — which the next FP8 prologue reads instead of sweeping y for its scale
    (prologue's x_amax). spans: where B can be nonzero (kernels.spans.rank_spans(B)); the Gluon kernel then
    expands each tile through its span only, the same rows (the Triton kernel, whose small batches the
    expand costs little, takes every rank). rope: q and k heads rotated as written (RopeCols): in the Gluon
    kernel's epilogue where it can (lora_gemm_ws.rope_ok), otherwise by the pass after (rope.rope_cols).

    FP8 and bf16 batches of tuning.WS_MIN_ROWS rows or more on a Hopper GPU go to the warp-specialized Gluon kernel
    (lora_gemm_ws.py), faster than the Triton kernel at W1's, W4's and W5's shapes (bench/sweep.py gemm_ws,
    bench/gemm_table.py, docs/performance.md). Both give bitwise the same rows (every case checked there, and
    tests/test_kernels.py::test_gemm_kernels_agree_bitwise), so the choice by M keeps batch invariance.
    Stacked ranks over 64 (r = 32 on q, k and v is 96) take the Gluon kernel at the same M, its expand in 64-rank
    pieces: the Triton kernel's 128x256 tiles spill at BR = 128 (2.7 KB a thread compiled for sm_90a, against
    1.0 KB at 64), and the Gluon kernel ran such ranks several times faster (docs/performance.md).
    gelu (with silu_out): GELU-tanh-and-mul, which only the Triton kernel has, so those calls stay there."""
    M, K = x.shape
    N = W.shape[0]
    if W.shape[1] != K or x.dtype != W.dtype:
        raise ValueError(f"x {tuple(x.shape)} {x.dtype} and W {tuple(W.shape)} {W.dtype} do not fit")
    if x.stride(1) != 1 or W.stride(1) != 1:
        raise ValueError("x and W need a contiguous last dimension")
    if (x_scale is None) != (w_scale is None) or \
            (x_scale is not None and (x_scale.numel() != M or w_scale.numel() != N)):
        raise ValueError("x_scale [M] and w_scale [N] come together")
    if (s is None) != (B is None):
        raise ValueError("s and B come together")
    R = 0
    if s is not None:
        R = s.shape[1]
        if s.dtype not in (torch.float32, B.dtype) or s.shape[0] != M or B.shape[1:] != (N, R) or B.stride(2) != 1:
            raise ValueError(f"s {tuple(s.shape)} {s.dtype} / B {tuple(B.shape)} do not fit M={M}, N={N}")
        if token_adapter.dtype != torch.int32 or token_adapter.numel() != M:
            raise ValueError("token_adapter must be int32 [M]")
    if residual is not None and (residual.shape != (M, N) or residual.stride(1) != 1):
        raise ValueError(f"residual must be [M, N] = [{M}, {N}] with a contiguous last dimension")
    if gelu and not silu_out:
        raise ValueError("gelu names the gated activation of a silu_out projection")
    if silu_out and (N % 2 or residual is not None or amax_weight is not None):
        raise ValueError("the SiLU epilogue needs an even N (gate/up rows interleaved), no residual and no "
                         "amax_weight")
    if amax_weight is not None and (not row_amax or amax_weight.shape != (N,) or amax_weight.stride(0) != 1):
        raise ValueError(f"amax_weight must be a contiguous [{N}] and comes with row_amax")
    if rope is not None and (silu_out or row_amax or rope.cols > N or rope.positions.shape != (M,)):
        raise ValueError(f"rope needs a plain projection of {M} rows and at least {rope.cols} columns")
    n_out = N // 2 if silu_out else N
    if out is not None and (out.shape != (M, n_out) or out.dtype != out_dtype or out.stride(1) != 1):
        raise ValueError(f"out must be [{M}, {n_out}] {out_dtype} with a contiguous last dimension")
    y = out if out is not None else torch.empty((M, n_out), dtype=out_dtype, device=x.device)
    # small batches stay on the Triton kernel (tuning.WS_MIN_ROWS says why)
    if (not config and not gelu and M >= WS_MIN_ROWS and lora_gemm_ws is not None
            and lora_gemm_ws.usable(x, W, y, residual, B)):
        amax = torch.empty((triton.cdiv(N, WS_BN), M), dtype=torch.float32, device=x.device) \
            if row_amax else None
        inside = rope is not None and lora_gemm_ws.rope_ok(rope)
        lora_gemm_ws.lora_gemm_ws(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, y, silu_out,
                                  amax=amax, amax_weight=amax_weight, spans=spans, rope=rope if inside else None)
    else:
        inside = False
        amax = _triton_gemm(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, y, silu_out, config,
                            row_amax, amax_weight, gelu)
    if rope is not None and not inside:
        rope_cols(y, rope)
    return (y, amax) if row_amax else y


def _triton_gemm(x: torch.Tensor, x_scale: torch.Tensor | None, W: torch.Tensor, w_scale: torch.Tensor | None,
                 s: torch.Tensor | None, B: torch.Tensor | None, token_adapter: torch.Tensor,
                 bias: torch.Tensor | None, residual: torch.Tensor | None, y: torch.Tensor, silu_out: bool,
                 config: dict | None, row_amax: bool, amax_weight: torch.Tensor | None,
                 gelu: bool = False) -> torch.Tensor | None:
    """The Triton kernels into y (arguments checked by lora_gemm); returns the row maxima when asked for."""
    (M, K), N = x.shape, W.shape[0]
    R = s.shape[1] if s is not None else 0
    cfg = {**gemm_tiles(M, N, x.dtype, x.device.type == "cpu"), **(config or {})}
    amax = torch.empty((triton.cdiv(N, cfg["BN"]), M), dtype=torch.float32, device=x.device) if row_amax else None
    if M == 0:
        return amax
    tma, persistent = cfg.pop("TMA", False) and tma_ok(x, W), cfg.pop("PERSISTENT", False)
    tiles = triton.cdiv(M, cfg["BM"]) * triton.cdiv(N, cfg["BN"])
    dummy = y
    silu = (1 if x.device.type == "cpu" else 2) if silu_out else 0  # 2: fast_math's form (no interpreter)
    if gelu:  # 4: libdevice's tanh (no interpreter)
        silu += 2
    if tma:
        # NUM_PROGS (the tile stride) is a constexpr: kept to a few values so that batches of new sizes do
        # not compile new kernels. Persistent: the SM count, with no more programs than tiles; otherwise
        # one tile per program and a stride of at least the tile count.
        stride = sm_count(x.device) if persistent else triton.next_power_of_2(tiles)
        progs = min(tiles, stride)
        xd = TensorDescriptor.from_tensor(x, [cfg["BM"], cfg["BK"]])
        wd = TensorDescriptor.from_tensor(W, [cfg["BN"], cfg["BK"]])
        _lora_gemm_tma_kernel[(progs,)](
            xd, wd, y, x_scale if x_scale is not None else dummy, w_scale if w_scale is not None else dummy,
            s if s is not None else dummy, B if B is not None else dummy,
            token_adapter, bias if bias is not None else dummy, residual if residual is not None else dummy,
            amax if row_amax else dummy, amax_weight if amax_weight is not None else dummy, M, N, K, R, y.stride(0),
            s.stride(0) if s is not None else 0, B.stride(0) if B is not None else 0,
            B.stride(1) if B is not None else 0, residual.stride(0) if residual is not None else 0,
            HAS_SCALE=x_scale is not None, HAS_LORA=s is not None, HAS_BIAS=bias is not None,
            HAS_RES=residual is not None, SILU_OUT=silu, AMAX=row_amax, AMAX_W=amax_weight is not None,
            PREC="ieee" if x.dtype == torch.float32 else "tf32",
            BR=max(16, triton.next_power_of_2(max(R, 1))), NUM_PROGS=stride, **cfg)
        return amax
    _lora_gemm_kernel[(tiles,)](
        x, W, y, x_scale if x_scale is not None else dummy, w_scale if w_scale is not None else dummy,
        s if s is not None else dummy, B if B is not None else dummy,
        token_adapter, bias if bias is not None else dummy, residual if residual is not None else dummy,
        amax if row_amax else dummy, amax_weight if amax_weight is not None else dummy, M, N, K, R, x.stride(0),
        W.stride(0), y.stride(0),
        s.stride(0) if s is not None else 0, B.stride(0) if B is not None else 0, B.stride(1) if B is not None else 0,
        residual.stride(0) if residual is not None else 0,
        HAS_SCALE=x_scale is not None, HAS_LORA=s is not None, HAS_BIAS=bias is not None,
        HAS_RES=residual is not None, SILU_OUT=silu, AMAX=row_amax, AMAX_W=amax_weight is not None,
        PREC="ieee" if x.dtype == torch.float32 else "tf32", BR=max(16, triton.next_power_of_2(max(R, 1))), **cfg)
    return amax
