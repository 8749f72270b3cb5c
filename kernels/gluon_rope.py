"""The rotary embedding of q and k heads as the Gluon GEMM writes them (lora_gemm_ws.py's epilogue).

Semantics: rope.rope_cols without head norms, on one output tile already rounded to its dtype and stored in
shared memory: every head of the tile whose columns lie in [0, rope_cols) rotated at its row's position,
fp32 inside, rounded again — the rope pass's instructions (rope._rope_kernel), so the rows are bitwise the same.

Why in the GEMM: a pass over k cost 0.8 ms a layer of W1's plan, and the attention rotating q as it loaded it
1.9 ms more than on rotated q (13.6 against 11.7 ms; .dev/s23_attn_rope.py, run 93). Here the tile is in
shared memory anyway, between the epilogue's store and the TMA store, while the other consumer's MMAs run:
W1's qkv GEMM at 32k rows 853.5 -> 897.8 us (RC 64; 903.6 at RC 32, 952.7 at 16; 884.3 without the table
loads; run 96). End to end that nets W1 +0.3% (A/B on one GPU, run 97): at the power cap the attention's saved
cycles were mostly stalls, and the tables' loads are work. The tile is rotated in chunks of RC rows
(registers: the accumulator is dead by then) through 2 x HALF-wide column slices of the swizzled buffer.
"""
from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl


@gluon.jit
def rope_tile(c_smem, off_m, off_n, M, pos_ptr, cos_ptr, sin_ptr, rope_cols, HALF: gl.constexpr, RC: gl.constexpr):
    BM: gl.constexpr = c_smem.type.shape[0]
    BN: gl.constexpr = c_smem.type.shape[1]
    # [RC, HALF] chunks over the warpgroup's 128 threads, 8 contiguous columns (16 bytes) a thread
    TC: gl.constexpr = HALF // 8
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [32 // TC, TC], [4, 1], [1, 0])
    rr = gl.arange(0, RC, layout=gl.SliceLayout(1, layout))
    rh = gl.arange(0, HALF, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, BM, RC):
        rows = off_m + r0 + rr
        pos = gl.load(pos_ptr + rows, mask=rows < M, other=0)
        tab = pos[:, None] * HALF + rh[None, :]
        c = gl.load(cos_ptr + tab)
        s = gl.load(sin_ptr + tab)
        chunk = c_smem.slice(r0, RC, dim=0)
        for h0 in gl.static_range(0, BN, 2 * HALF):
            if off_n + h0 < rope_cols:
                x1 = chunk.slice(h0, HALF, dim=1)
                x2 = chunk.slice(h0 + HALF, HALF, dim=1)
                a = x1.load(layout).to(gl.float32)
                b = x2.load(layout).to(gl.float32)
                x1.store(gl.fma(a, c, -(b * s)).to(c_smem.dtype))
                x2.store(gl.fma(b, c, a * s).to(c_smem.dtype))
