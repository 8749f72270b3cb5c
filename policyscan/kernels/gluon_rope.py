"""The rotary embedding of q and k heads as the Gluon GEMM writes them (lora_gemm_ws.py's epilogue).

Semantics: rope.rope_cols without head norms, on one output tile already rounded to its dtype: every head of
the tile whose columns lie in [0, rope_cols) rotated at its row's position, fp32 inside, rounded again — the
rope pass's instructions (rope._rope_kernel), so the rows are bitwise the same.

Why in the GEMM: a pass of its own over k, and the attention rotating q as it loads it, each cost more than the
rotation in the epilogue does (docs/performance.md).
Why in registers: in wgmma's accumulator layout a thread holds column n and its rotate-half partner n + HALF
(both bit patterns differ in a register-index bit), so the rotation is a renaming of registers, with no round
trip through shared memory (within the noise end to end, 136 fewer instructions a tile and thread).
Why packed tables (reference.pack_rope: fp16 cos and sin in one int32 word): the rope's cost at the GPU's power
cap is its table loads and arithmetic, and packed tables, half the bytes and 32 instead of 64 8-byte loads a
thread and tile (SASS for sm_90a), win back part of it (docs/performance.md; timed with bf16 halves, and fp16's
are as many instructions, an HADD2.F32 a value where bf16 took a shift or a mask).
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from policyscan.kernels.fast_math import bf16_to_f32, to_bf16


@gluon.jit
def rope_regs(out, off_m, off_n, M, pos_ptr, cs_ptr, rope_cols, HALF: gl.constexpr):
    """out [BM, BN] (rounded to y's dtype, in any distributed layout) with its heads rotated, same layout;
    cs_ptr: the packed cos/sin table (reference.pack_rope)."""
    BM: gl.constexpr = out.shape[0]
    BN: gl.constexpr = out.shape[1]
    NH: gl.constexpr = BN // (2 * HALF)  # heads in the tile
    # column (2 h + j) HALF + f -> [BM, HALF, NH, 2]: split takes j, the half of the head
    x1, x2 = gl.split(gl.permute(gl.reshape(out, [BM, NH, 2, HALF]), [0, 3, 1, 2]))
    x1 = gl.reshape(x1, [BM, HALF * NH])  # column f NH + h
    x2 = gl.reshape(x2, [BM, HALF * NH])
    L: gl.constexpr = x1.type.layout
    rows = off_m + gl.arange(0, BM, layout=gl.SliceLayout(1, L))
    k = gl.arange(0, HALF * NH, layout=gl.SliceLayout(0, L))
    pos = gl.load(pos_ptr + rows, mask=rows < M, other=0)
    tab = pos[:, None] * HALF + (k // NH)[None, :]
    cs = gl.load(cs_ptr + tab)
    c = cs.to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)  # the low half, then the high half
    s = (cs >> 16).to(gl.int16).to(gl.float16, bitcast=True).to(gl.float32)
    a = bf16_to_f32(x1)  # fast_math.py's packed conversions: the same bits as .to()
    b = bf16_to_f32(x2)
    y1 = to_bf16(gl.fma(a, c, -(b * s)))
    y2 = to_bf16(gl.fma(b, c, a * s))
    if NH > 1:  # a tile of several heads may end past rope_cols (v's columns); the caller checks a one-head tile
        rot = (off_n + (k % NH) * (2 * HALF) < rope_cols)[None, :]
        y1 = gl.where(rot, y1, x1)
        y2 = gl.where(rot, y2, x2)
    y = gl.join(gl.reshape(y1, [BM, HALF, NH]), gl.reshape(y2, [BM, HALF, NH]))
    return gl.convert_layout(gl.reshape(gl.permute(y, [0, 2, 3, 1]), [BM, BN]), out.type.layout)
