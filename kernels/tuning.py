"""Every launch knob of the kernels, in one place: tile shapes, warps, pipeline stages, register caps, and the row
count that picks the Gluon GEMM. Each launcher reads its knobs here; its `config` argument overrides them
(bench/sweep.py sweeps them so). Figures: bench/sweep.py on one H200 at W1's and W4's shapes (docs/performance.md).

Batch invariance: every choice here depends on shapes, dtypes and ranks, never on the number of rows, except
WS_MIN_ROWS, which picks between two kernels that give bitwise the same rows. Some knobs set a reduction order (a
GEMM's or a prologue's BK, the attention's key block BN): changing one may move f's last bits, for every batch
alike, so the recorded results of earlier runs would no longer reproduce bit for bit.
"""
from __future__ import annotations

import torch
import triton

# --- lora_gemm.py: the Triton GEMM ---

# FP8 batches of this many rows or more take the Gluon GEMM on Hopper. At M = 300 the Triton kernel's 13 us beat
# the ping-pong's 14 us (72 tiles of 128x128 leave each program one tile, so nothing overlaps; bench/run.py --gemm),
# and at 64-300 rows it wins at every rank, 1.04-1.85x, spilling or not. Past 1024 rows the Gluon kernel is ahead:
# a W1 layer's four GEMMs 1.02x at 1280 rows, 1.11-1.13x at 1536-2048; W4's 1.01x, 1.02-1.08x (at 768, 0.94x / 1.01x).
WS_MIN_ROWS = 1025


def gemm_tiles(M: int, N: int, dtype: torch.dtype, interpret: bool) -> dict:
    """The Triton GEMM's tile shape. BK is fixed per dtype: it sets the order of the K reduction, so a row's result
    is the same whatever the batch (checked bitwise by test_lora_gemm_rows_do_not_depend_on_batch). BM/BN and the
    feed (pointers or TMA, persistent or not) only choose which rows and columns share a program.

    Large M: TMA-fed, persistent, 128x256x128, 8 warps, 3 stages, best at all four W1 shapes at 16k rows:
    1068 / 969 / 1073 / 1155 TF/s for N,K = 5120,3072 / 3072,3072 / 16384,3072 / 3072,8192, against
    1035 / 802 / 1023 / 953 for the pointer-fed kernel this replaced (which also used 128-wide N tiles below
    N=4096) and 1132 / 1087 / 1140 / 1197 for torch._scaled_mm. Small M: 128x256 tiles leave most of the 132 SMs
    idle (36 tiles at M=300, N=3072: 2.9x bare _scaled_mm), so narrower tiles there. The bf16 path keeps the
    pointer-fed tiles it was measured with."""
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
        # the widest tile that still gives 64 or more tiles: best or within 4% of the best of nine configs
        # at M = 512 and 2048 on the four W1 shapes, 1.2-1.45x the 64x128 tiles used before
        bn = 256 if triton.cdiv(M, 128) * triton.cdiv(N, 256) >= 64 else 128
        return dict(BM=128, BN=bn, BK=bk, GROUP_M=8, num_warps=8, num_stages=3, TMA=True)
    return dict(BM=128, BN=256, BK=bk, GROUP_M=8, num_warps=8, num_stages=3, TMA=True, PERSISTENT=True)


# --- lora_gemm_ws.py: the warp-specialized Gluon GEMM ---

# 128x128 tiles, one per consumer warpgroup; 4 stages of 32 KB + two 32 KB output tiles + two B slices: 200 KB of
# the 227 KB of shared memory (5 stages fit only at gate_up: 1432 us against 4 stages' 1373)
WS_BM, WS_BN, WS_BK, WS_STAGES = 128, 128, 128, 4
WS_WARPS, WS_MAXNREG = 4, 168  # what the kernel's register split (232 a consumer, 40 the loader) is sized for


def ws_group_m(N: int) -> int:
    """Row tiles a group in the grouped tile order: a group's row tiles share each W tile while it is in L2; at the
    700 W cap W's DRAM re-reads are energy. W1's gate_up (50 MB of W), held for seconds: groups 1 / 4 / 16
    1075 / 1156 / 1228 TF/s, 16 / 24 / 32 1229 / 1249 / 1220; W1 end to end +0.5% at 24 (178.7k against 177.8k,
    every pass; with qkv at 24 too, none). Narrow N (o, down) at 12, not the 8 of burst timings: held at the cap
    o 1111 -> 1128 TF/s, down 1218 -> 1228; W1 end to end +0.23% every one of 4 alternating passes, 16 -0.2%.
    The order changes no output bit; a snake order lost 0.4% end to end."""
    return 24 if N >= 16384 else 16 if N >= 4096 else 12


# --- prologue.py: the Triton prologue ---

PROLOGUE_BP = 16  # partial row maxima read a step


def prologue_tiles(K: int, R: int, BR: int, norm: bool, quant: bool, itemsize: int, interpret: bool) -> dict:
    """The Triton prologue's tiles (BM, BK, num_warps, num_stages where not Triton's 3, ONE_AD: the single-adapter
    sweep) for width K, rank R (BR padded) and x's element size. They depend on K and R only, never on M.

    Per kind, each sweeping once: a norm 64-row programs, 4 warps (qkv 139 -> 89 us a 16k batch against 8 warps,
    gate_up 75 -> 71 against 32 rows). Quantizing without a norm, the single-adapter sweep at 64 rows and 256-wide
    chunks: o 72 -> 60 us, down 190 -> 168, W4's o 49 -> 41 against the adapter loop at 32 rows; the 16-bit path
    was not measured with it. Quantizing with a norm, since its shrink reads x as loaded, the single-adapter sweep
    too, in 64-wide chunks 4 stages deep up to rank 32 and 128-wide at 33-64 (W1's 32k batch: gate_up's rank 32
    149.0 -> 95.8 us, qkv's 48 156.3 -> 115.9, against the u16 shrink's adapter loop; 64-wide chunks at 48: 150.6)."""
    if interpret:
        cfg = dict(BM=16, BK=32, num_warps=4, ONE_AD=True)
    elif norm and quant:
        cfg = dict(BM=64, BK=64, num_warps=4, num_stages=4, ONE_AD=True) if BR <= 32 else \
            dict(BM=64, BK=128, num_warps=4, ONE_AD=True)
    elif norm:  # 16-bit: two sweeps
        cfg = dict(BM=64 if R > 32 else 32, BK=128, num_warps=8 if R > 32 else 4, ONE_AD=False)
    elif quant:  # 2 stages, not 3: 80 KB of shared memory a program, so two an SM where 120 KB left room for one;
        # W1 +0.5% end to end in two A/Bs, every pass, f bitwise the same
        cfg = dict(BM=64, BK=256, num_warps=4, num_stages=2, ONE_AD=True)
    else:
        cfg = dict(BM=32, BK=256, num_warps=4, ONE_AD=False)
    cfg["BK"] = min(cfg["BK"], max(16, triton.next_power_of_2(K)))
    # Stacked ranks past 64: the stages' x and A chunks must fit shared memory (quantizing without a norm at
    # rank 96 asked for 262,144 of 232,448 bytes); 200 KiB keeps every config measured at ranks <= 64
    while not interpret and cfg.get("num_stages", 3) * (BR + cfg["BM"]) * cfg["BK"] * itemsize > 200 << 10:
        cfg["BK"] //= 2
    return cfg


# --- gluon_prologue.py: the TMA-fed Gluon prologue ---

GP_BM, GP_BKS = 64, 64  # a row block, and one TMA box of x: 64 bf16 columns are 128 bytes, the widest swizzle
GP_BP = 16  # partial row maxima read a step
# 2 boxes a stage, 3 stages and two programs an SM (112 KB of shared memory each at rank 64, 128 registers a
# thread) were the best of 8 rings for the norm prologues and within 5% for the others
GP_SUB, GP_STAGES, GP_PROGRAMS_PER_SM = 2, 3, 2
GP_WARPS, GP_MAXNREG = 4, 128  # the register cap only with two programs an SM


# --- attention.py ---

def attention_tiles(G: int, D: int, interpret: bool) -> dict:
    """Query rows (BQ queries of G heads), key block BN, warps, stages and register cap for heads of width D.

    BQ * G <= 64 rows (16 queries of 4 heads at W4's group, 21 of 3 at W1's), 32-key blocks, 4 warps, 3 stages:
    the best of 32 configs at both heads (bench/sweep.py attention; W1's group then padded to 4 heads), W1's
    291 us against the one-head kernel's 301, W4's 185 against 208, with bitwise the same rows. maxnreg 168: three
    programs an SM instead of two (254 registers at W1's heads then, rotating q): W1's heads 330 -> 289 us, W4's
    202 -> 201. On q rotated by the qkv GEMM, 128-wide heads take 2 stages and maxnreg 128 (four programs an SM):
    W1 +0.4% end to end, every one of 3 alternating passes (173.2k against 172.5k mean; 11.6 against 11.7 ms
    over a layer of its plan); at W4's 64-wide heads that lost 9% (9.3 against 8.6 ms), so narrower heads keep
    3 stages and 168. Rescaling the accumulator only when a row maximum grows past 2^8 (FlashAttention-4's lazy
    rescale: a block-wide branch) lost 1.3% end to end at W1, 2.6% with 64-key blocks; exp2 as ex2.approx.ftz
    changed nothing."""
    if interpret:
        return dict(BQ=max(1, 16 // G), BN=16, num_warps=4, num_stages=1)
    wide = D >= 128
    return dict(BQ=max(1, 64 // G), BN=32, num_warps=4, num_stages=2 if wide else 3, maxnreg=128 if wide else 168)


# --- head.py, rope.py ---

def head_warps(BH: int) -> int:
    """Warps of the head's one-row programs, for rows padded to BH columns."""
    return 8 if BH >= 2048 else 4


def rope_tiles(interpret: bool) -> dict:
    """Rows a program (BM) and warps of the rope pass."""
    return dict(BM=16 if interpret else 64, num_warps=4)
