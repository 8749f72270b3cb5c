"""Where a stacked LoRA B can be nonzero, per block of output columns: the expand may skip the rest.

Semantics: for RankSpans(start, width, cols) of B [n, N, R], every adapter's B[:, c, r] is zero for
r outside [start[c // cols], start[c // cols] + width) (start -1: zero at every rank). A GEMM given it
computes the same y; lora_gemm_ws uses it to expand each 128-column tile through `width` ranks instead of
all R.

Why: q, k and v share one GEMM, so their ranks stack (W1: 3 x 16 = 48, padded to 64) while B is block
diagonal: a q column has only q's 16 ranks. The 48-rank expand cost the qkv GEMM several times what a 16-rank
one does; through spans most of that comes back, at W1's and W4's shapes and end to end (docs/performance.md).
Bitwise: starts are multiples of 16, the k of one bf16 MMA instruction, so the instructions kept are those
of the whole expand, in the same order, and those skipped add products that are all exactly zero.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

ALIGN = 16  # ranks per bf16 MMA instruction (k16)


@dataclass(frozen=True)
class RankSpans:
    start: torch.Tensor  # int32 [cdiv(N, cols)], multiples of ALIGN, or -1
    width: int           # a power of two >= ALIGN
    cols: int

    def __post_init__(self) -> None:
        if self.start.dtype != torch.int32 or self.start.dim() != 1:
            raise ValueError(f"span starts must be int32 [blocks], got {self.start.dtype} {tuple(self.start.shape)}")
        if self.width < ALIGN or self.width & (self.width - 1) or self.cols < 1:
            raise ValueError(f"span width must be a power of two >= {ALIGN}, got {self.width} (cols {self.cols})")

    def narrow(self, col0: int, ncols: int) -> RankSpans | None:
        """The spans of B[:, col0:col0 + ncols] (None where col0 does not fall on a block boundary)."""
        if col0 % self.cols:
            return None
        b0 = col0 // self.cols
        return RankSpans(self.start[b0:b0 + -(-ncols // self.cols)], self.width, self.cols)


def rank_spans(B: torch.Tensor, cols: int = 128) -> RankSpans | None:
    """The spans of B [n, N, R] for blocks of `cols` columns; None when they would not narrow the expand
    (the widest span, rounded up to a power of two, is as wide as the padded rank)."""
    n, N, R = B.shape
    padded = max(ALIGN, 1 << max(0, R - 1).bit_length())
    blocks = -(-N // cols)
    nz = F.pad((B != 0).any(0), (0, 0, 0, blocks * cols - N)).view(blocks, cols, R).any(1)  # [blocks, R]
    has = nz.any(1)
    ranks = torch.arange(R, device=B.device)
    lo = torch.where(nz, ranks, R).amin(1) // ALIGN * ALIGN
    hi = torch.where(nz, ranks + 1, 0).amax(1)
    need = int(torch.where(has, hi - lo, 0).max()) if blocks else 0
    width = max(ALIGN, 1 << max(0, need - 1).bit_length())
    if width >= padded:
        return None
    return RankSpans(torch.where(has, lo, -1).to(torch.int32), width, cols)
