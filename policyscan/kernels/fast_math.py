"""Approximate fp32 math in named instructions, for epilogues and prologues that run on every element.

Semantics: rcp(x) = 1 / x (rcp.approx.ftz.f32); ex2(x) = 2 ** x (ex2.approx.ftz.f32); silu_mul(g, u, FAST) =
silu(g) * u = g / (1 + exp(-g)) * u, as g * rcp(1 + ex2(-g * log2 e)) * u when FAST; to_bf16(x) =
x.to(bfloat16) (round to nearest even); bf16_to_f32(x) = x.to(float32); tanh(x, LIB) = tanh(x), libdevice's
(about 1 ulp) when LIB, else 1 - 2 / (exp(2x) + 1) (absolute error about 1e-7: the interpreter has no libdevice);
gelu_tanh_mul(g, u, LIB) = gelu_pytorch_tanh(g) * u.

Why: Triton compiles exp and fp32 '/' to ex2.approx and div.full.f32 with range fixes around each (a compare
and predicated multiplies on every element): SiLU took about 13 instructions an element where these take 6,
and the prologue's u / scale three multiplies where one by the row's reciprocal does. In range the products
are the same bits: div.full(x, y) is x * rcp.approx(y) for 2^-126 <= |y| <= 2^126 (a whole W1 pass gave
bitwise the same f with the fast SiLU). Out of range: silu gives -0 for g < -87 (true value about
-1e-36); the prologue's scale is kept at 2^-126 or more (reference.quantize_rows). At the GPU's power cap fewer
instructions is more clock: the fast SiLU, and the prologue's reciprocal with it, each made W1 faster end to end
(docs/performance.md). The interpreter (CPU) has no inline assembly: callers take the plain formulas there (FAST
false).
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra import libdevice


@triton.jit
def rcp(x):
    return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def ex2(x):
    return tl.inline_asm_elementwise("ex2.approx.ftz.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                     pack=1)


@triton.jit
def silu_mul(g, u, FAST: tl.constexpr):
    if FAST:
        return g * rcp(1.0 + ex2(g * -1.4426950408889634)) * u
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def to_bf16(x):
    """x.to(bfloat16), two elements a cvt.rn.bf16x2.f32. Where an epilogue stores y.to(bf16) and also needs
    those values in fp32 (the o and down projections' row maxima of |y * next norm weight|), the compiler
    converted one element an F2F and then permuted and shifted bytes: with these two, o's epilogue (SASS for
    sm_90a) has 128 instructions fewer a tile and thread, out of ~2200; end to end, together with the attention's
    max before scale, within the noise (docs/performance.md)."""
    return tl.inline_asm_elementwise("cvt.rn.bf16x2.f32 $0, $2, $1;", "=r,r,r", [x], dtype=tl.bfloat16,
                                     is_pure=True, pack=2)


@triton.jit
def bf16_to_f32(x):
    """x.to(float32) for bf16 x, two elements a register: a shift and a mask."""
    return tl.inline_asm_elementwise("{ shl.b32 $0, $2, 16; and.b32 $1, $2, 0xffff0000; }", "=r,=r,r", [x],
                                     dtype=tl.float32, is_pure=True, pack=2)


@triton.jit
def tanh(x, LIB: tl.constexpr):
    if LIB:
        return libdevice.tanh(x)
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def gelu_tanh_mul(g, u, LIB: tl.constexpr):
    """0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))) u, torch's gelu(approximate="tanh")."""
    return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g), LIB)) * u
