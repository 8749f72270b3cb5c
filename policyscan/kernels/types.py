"""Shapes and tables the kernels and their torch twins share (kernels/reference.py re-exports them)."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch


@dataclass(frozen=True)
class AttnShape:
    """How q, k, v sit in one row of the fused qkv projection: [q heads | k heads | v heads] x head_dim."""

    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}; "
                             f"head_dim {self.head_dim} must be even (rotary halves)")


@dataclass(frozen=True)
class PrefixKV:
    """One layer's cached qkv rows of the per-policy prompt prefixes, and which rows each sequence reads.

    Sequence b attends first to rows[start[b] : start[b] + length[b]] (positions 0 .. length-1), then to its
    own tokens (positions length[b] ...). length 0: no prefix. Only the k and v parts of the rows are read."""

    rows: torch.Tensor    # [P_total, (H + 2 Hkv) D]
    start: torch.Tensor   # [B] int32
    length: torch.Tensor  # [B] int32


@dataclass(frozen=True)
class RopeCols:
    """The rotary embedding of a projection's output, applied by lora_gemm as it writes it. Columns [0, cols)
    hold heads of head_dim columns, q heads [0, q_cols) first, then k heads; each head is normed (Qwen3's
    q_norm / k_norm, rounded to the output dtype) when norms are given, then rotated at its row's position
    (cos/sin tables [P, head_dim / 2] fp32; fp32 inside, rounded to the output dtype). Later columns (v) are
    left alone. `packed`, when given, holds the same tables as pack_rope packs them: what the Gluon GEMM's
    epilogue reads (lora_gemm_ws.rope_ok); without it the pass after the GEMM rotates, with the same bits."""

    positions: torch.Tensor  # [M] int64, each row's position in its sequence (a cached prefix included)
    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int
    cols: int
    q_cols: int = 0
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    packed: torch.Tensor | None = None  # [P, head_dim / 2] int32

    def __post_init__(self) -> None:
        D = self.head_dim
        if D % 2 or self.cols % D or self.q_cols % D or not 0 <= self.q_cols <= self.cols:
            raise ValueError(f"rope columns {self.q_cols} (q) of {self.cols} must be whole heads of {D} (even)")
        c, s = self.cos, self.sin
        if (c.shape != s.shape or c.dim() != 2 or c.shape[1] != D // 2 or c.dtype != torch.float32
                or s.dtype != torch.float32 or not (c.is_contiguous() and s.is_contiguous())):
            raise ValueError(f"cos/sin must be contiguous fp32 [positions, {D // 2}], got {tuple(c.shape)}")
        pk = self.packed
        if pk is not None and (pk.shape != c.shape or pk.dtype != torch.int32 or not pk.is_contiguous()):
            raise ValueError(f"packed rope tables must be contiguous int32 {tuple(c.shape)} (pack_rope)")
        if self.positions.dim() != 1 or self.positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 [rows], got {self.positions.dtype} "
                             f"{tuple(self.positions.shape)}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        if self.normed and (self.q_norm.shape != (D,) or self.k_norm.shape != (D,)):
            raise ValueError(f"q_norm and k_norm must be [{D}]")

    @property
    def normed(self) -> bool:
        return self.q_norm is not None

    def split(self, split: int, rows: torch.Tensor) -> tuple[RopeCols, RopeCols]:
        """For DenseLoraLinear.split_rows: columns [:split] at `rows`, and columns [split:] at every row."""
        head = replace(self, positions=self.positions[rows], cols=min(self.cols, split),
                       q_cols=min(self.q_cols, split))
        tail = replace(self, cols=max(self.cols - split, 0), q_cols=max(self.q_cols - split, 0))
        return head, tail
