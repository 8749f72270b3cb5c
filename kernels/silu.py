"""SiLU-and-mul for the gate_up epilogues of both FP8 GEMM kernels, in the same instructions.

Semantics: silu(g) * u = g / (1 + exp(-g)) * u in fp32 (as torch.nn.functional.silu(g) * u, to the
approximations' rounding). FAST (on the GPU): e = ex2.approx.ftz(-g * log2 e), g * rcp.approx.ftz(1 + e) * u.

Why: Triton compiles exp and fp32 '/' to ex2.approx and div.full.f32 with range fixes around them (a compare
and two predicated multiplies each), about 13 instructions an element where these take 6. The products are
the same bits wherever 1 + e < 2^126, i.e. g > -87 (a whole W1 pass gave bitwise the same f, run 104); below,
where the true value is about -1e-36, this gives -0. W1 +0.6% end to end (run 104: 174.1k against 173.1k mean
over 3 alternating passes), the power cap's reward for fewer instructions in gate_up's epilogue.
The interpreter (CPU) has no inline assembly: it takes the plain formula (FAST false).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def silu_mul(g, u, FAST: tl.constexpr):
    if FAST:
        e = tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [g * -1.4426950408889634],
                                      dtype=tl.float32, is_pure=True, pack=1)
        r = tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [1.0 + e], dtype=tl.float32,
                                      is_pure=True, pack=1)
        return g * r * u
    return g / (1.0 + tl.exp(-g)) * u
