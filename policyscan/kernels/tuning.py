"""Every launch knob of the kernels, in one place: tile shapes, warps, pipeline stages, register caps, and the row
count that picks the Gluon GEMM. Each launcher reads its knobs here; its `config` argument overrides them
(bench/sweep.py sweeps them so). Each says why it was chosen; the figures, bench/sweep.py's on one H200 at W1's
and W4's shapes, are in docs/performance.md.

Batch invariance: every choice here depends on shapes, dtypes and ranks, never on the number of rows, except
WS_MIN_ROWS, which picks between two kernels that give bitwise the same rows. Some knobs set a reduction order (a
GEMM's or a prologue's BK, the attention's key block BN): changing one may move f's last bits, for every batch
alike, so the recorded results of earlier runs would no longer reproduce bit for bit.
"""
from __future__ import annotations

import torch
import triton

# --- lora_gemm.py: the Triton GEMM ---

# FP8 and bf16 batches of this many rows or more take the Gluon GEMM on Hopper. Below, the Triton kernel wins in FP8
# at every rank, spilling or not: at a few hundred rows the ping-pong's 128x128 tiles leave each program one tile, so
# nothing overlaps (bench/run.py --gemm). Past 1024 rows the Gluon kernel is ahead on W1's and W4's four FP8 GEMMs,
# and at 768 not yet; in bf16 it is far ahead of the Triton kernel from 2048 rows on (bench/gemm_table.py;
# docs/performance.md). bf16 keeps the FP8 threshold: its smaller batches were not timed.
WS_MIN_ROWS = 1025


def gemm_tiles(M: int, N: int, dtype: torch.dtype, interpret: bool) -> dict:
    """The Triton GEMM's tile shape. BK is fixed per dtype: it sets the order of the K reduction, so a row's result
    is the same whatever the batch (checked bitwise by test_lora_gemm_rows_do_not_depend_on_batch). BM/BN and the
    feed (pointers or TMA, persistent or not) only choose which rows and columns share a program.

    Large M: TMA-fed, persistent, 128x256x128, 8 warps, 3 stages, the best at all four W1 shapes (N,K = 5120,3072 /
    3072,3072 / 16384,3072 / 3072,8192) at 16k rows, ahead of the pointer-fed kernel it replaced (which also used
    128-wide N tiles below N=4096) and a little behind torch._scaled_mm without the LoRA. Small M: 128x256 tiles
    leave most of the 132 SMs idle (36 tiles at M=300, N=3072), so narrower tiles there (docs/performance.md). The
    bf16 path keeps the pointer-fed tiles it was tuned with; bf16 batches past WS_MIN_ROWS go to the Gluon GEMM."""
    if interpret:
        return dict(BM=16, BN=32, BK=32, GROUP_M=4, num_warps=4, num_stages=1)
    bk = 128 if dtype == torch.float8_e4m3fn else 64
    if dtype != torch.float8_e4m3fn:
        if M <= 2048:
            return dict(BM=64, BN=128, BK=bk, GROUP_M=8, num_warps=4, num_stages=4)
        return dict(BM=128, BN=128 if N >= 2048 else 64, BK=bk, GROUP_M=8, num_warps=8, num_stages=3)
    if M <= 256:
        return dict(BM=64, BN=128, BK=bk, GROUP_M=8, num_warps=4, num_stages=4)
    if M <= 2048:
        # the widest tile that still gives 64 or more tiles: the best or near it of nine configs at M = 512 and
        # 2048 on the four W1 shapes, well ahead of the 64x128 tiles used before (docs/performance.md)
        bn = 256 if triton.cdiv(M, 128) * triton.cdiv(N, 256) >= 64 else 128
        return dict(BM=128, BN=bn, BK=bk, GROUP_M=8, num_warps=8, num_stages=3, TMA=True)
    return dict(BM=128, BN=256, BK=bk, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True)


# --- lora_gemm_ws.py: the warp-specialized Gluon GEMM ---

# 128x128 tiles, one per consumer warpgroup; 4 stages of 32 KB + two 32 KB output tiles + two B slices: 200 KB of
# the 227 KB of shared memory (5 stages fit only at gate_up, and were slower there; docs/performance.md)
WS_BM, WS_BN, WS_STAGES = 128, 128, 4


def ws_bk(dtype: torch.dtype) -> int:
    """The Gluon GEMM's K step: 128 FP8 or 64 bf16 columns, 32 KB of x and W tiles a stage either way. It is the
    Triton kernel's BK for the dtype (gemm_tiles), so that the two kernels reduce K in the same order."""
    return 128 if dtype == torch.float8_e4m3fn else 64
WS_WARPS, WS_MAXNREG = 4, 168  # what the kernel's register split (232 a consumer, 40 the loader) is sized for


def ws_group_m(N: int) -> int:
    """Row tiles a group in the grouped tile order: a group's row tiles share each W tile while it is in L2; at the
    700 W cap W's DRAM re-reads are energy. Wide N (W1's gate_up, 50 MB of W) at 24, the best group held at the
    cap and a gain end to end (qkv at 24 too gained nothing); narrow N (o, down) at 12, not the 8 of burst timings,
    a gain end to end held at the cap, where 16 lost (docs/performance.md). The order changes no output bit; a
    snake order lost end to end."""
    return 24 if N >= 16384 else 16 if N >= 4096 else 12


# --- prologue.py: the Triton prologue ---

PROLOGUE_BP = 16  # partial row maxima read a step


def prologue_tiles(K: int, R: int, BR: int, norm: bool, quant: bool, itemsize: int, interpret: bool) -> dict:
    """The Triton prologue's tiles (BM, BK, num_warps, num_stages where not Triton's 3, ONE_AD: the single-adapter
    sweep) for width K, rank R (BR padded) and x's element size. They depend on K and R only, never on M.

    Per kind, each sweeping once: a norm 64-row programs, 4 warps (faster than 8 warps, and than 32-row programs).
    Quantizing without a norm, the single-adapter sweep at 64 rows and 256-wide chunks, faster than the adapter
    loop at 32 rows; the 16-bit path was not tried with it. Quantizing with a norm, since its shrink reads x as
    loaded, the single-adapter sweep too, in 64-wide chunks 4 stages deep up to rank 32 and 128-wide at 33-64,
    faster than the u16 shrink's adapter loop, and 128-wide than 64-wide chunks at rank 48 (docs/performance.md)."""
    if interpret:
        cfg = dict(BM=16, BK=32, num_warps=4, ONE_AD=True)
    elif norm and quant:
        cfg = dict(BM=64, BK=64, num_warps=4, num_stages=4, ONE_AD=True) if BR <= 32 else \
            dict(BM=64, BK=128, num_warps=4, ONE_AD=True)
    elif norm:  # 16-bit: two sweeps
        cfg = dict(BM=64 if R > 32 else 32, BK=128, num_warps=8 if R > 32 else 4, ONE_AD=False)
    elif quant:  # 2 stages, not 3: 80 KB of shared memory a program, so two an SM where 120 KB left room for one;
        # faster end to end in two A/Bs (docs/performance.md), f bitwise the same
        cfg = dict(BM=64, BK=256, num_warps=4, num_stages=2, ONE_AD=True)
    else:
        cfg = dict(BM=32, BK=256, num_warps=4, ONE_AD=False)
    cfg["BK"] = min(cfg["BK"], max(16, triton.next_power_of_2(K)))
    # Stacked ranks past 64: the stages' x and A chunks must fit shared memory (quantizing without a norm at
    # rank 96 asked for 262,144 of 232,448 bytes); 200 KiB keeps every config tuned at ranks <= 64
    while not interpret and cfg.get("num_stages", 3) * (BR + cfg["BM"]) * cfg["BK"] * itemsize > 200 << 10:
        cfg["BK"] //= 2
    return cfg


# --- gluon_prologue.py: the TMA-fed Gluon prologue ---

GP_BM, GP_BKS = 64, 64  # a row block, and one TMA box of x: 64 bf16 columns are 128 bytes, the widest swizzle
GP_BP = 16  # partial row maxima read a step
# 2 boxes a stage, 3 stages and two programs an SM (112 KB of shared memory each at rank 64, 128 registers a
# thread) were the best of 8 rings for the norm prologues and near the best for the others (docs/performance.md)
GP_SUB, GP_STAGES, GP_PROGRAMS_PER_SM = 2, 3, 2
GP_WARPS, GP_MAXNREG = 4, 128  # the register cap only with two programs an SM


# --- attention.py ---

def attention_tiles(G: int, D: int, interpret: bool) -> dict:
    """Query rows (BQ queries of G heads), key block BN, warps, stages and register cap for heads of width D.

    BQ * G <= 64 rows (16 queries of 4 heads at W4's group, 21 of 3 at W1's), 32-key blocks, 4 warps, 3 stages: the
    best of 32 configs at both heads (bench/sweep.py attention; W1's group then padded to 4 heads), faster than one
    head a program, with bitwise the same rows. maxnreg 168: three programs an SM instead of two (254 registers at
    W1's heads then, rotating q), faster at W1's heads. On q rotated by the qkv GEMM, 128-wide heads take 2 stages
    and maxnreg 128 (four programs an SM), a gain end to end at W1 that lost at W4's 64-wide heads, so narrower
    heads keep 3 stages and 168. Heads wider than 128 do not fit 4 warps' registers: 8 warps. Rescaling the
    accumulator only when a row maximum grows past 2^8 (FlashAttention-4's lazy rescale: a block-wide branch) lost
    end to end; exp2 as ex2.approx.ftz changed nothing (docs/performance.md).
    """
    if interpret:
        return dict(BQ=max(1, 16 // G), BN=16, num_warps=4, num_stages=1)
    if D > 128:  # Gemma 3's 256-wide heads: a 64-row accumulator needs 8 warps' registers, uncapped
        return dict(BQ=max(1, 64 // G), BN=32, num_warps=8, num_stages=2)
    wide = D >= 128
    return dict(BQ=max(1, 64 // G), BN=32, num_warps=4, num_stages=2 if wide else 3, maxnreg=128 if wide else 168)


def attention_long_tile(G: int, D: int, interpret: bool) -> tuple[int, dict] | None:
    """(keys, tile): a sequence of at least `keys` keys, cached prefix included, takes this tile instead of
    attention_tiles'; None: one tile for every length.

    128 rows of 8 warps in 64-key blocks, 3 stages, on 128-wide heads: it reads q once a warpgroup for twice the
    keys (bench/attention_ptx.py: 31 FLOP a shared-memory byte against 21), but one program fills an SM, so it wins
    only where the key loop is long. On an H100 (bench/gemm_table.py --sweep): W5's packed first batch 397 against
    370 TFLOP/s, 16 x 4096 407 against 367, 64 x 1024 298 against 312, W1's packed batch 151 against 209. The tile
    is chosen by the sequence's own key count, so a sequence gets the same bits in any batch and with its prefix
    cached or inline. In the interpreter a low threshold, so that the tests run both tiles."""
    if interpret:
        return 40, dict(BQ=max(1, 32 // G), BN=32, num_warps=4, num_stages=1)
    if D != 128:
        return None
    return 2048, dict(BQ=max(1, 128 // G), BN=64, num_warps=8, num_stages=3)


# --- head.py, rope.py ---

def head_warps(BH: int) -> int:
    """Warps of the head's one-row programs, for rows padded to BH columns."""
    return 8 if BH >= 2048 else 4


def rope_tiles(interpret: bool) -> dict:
    """Rows a program (BM) and warps of the rope pass."""
    return dict(BM=16 if interpret else 64, num_warps=4)
