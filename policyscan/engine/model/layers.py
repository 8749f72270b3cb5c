"""Linear layers with stacked multi-LoRA. Each is two kernels: a prologue over the activations, then one GEMM.

Quantization is a swap of the layer class at load time (the loader takes `Fp8LoraLinear` where the engine's
Precision says w8a8, else `DenseLoraLinear`): no layer and no forward pass branches on precision. `ops` is the
kernel set (kernels.reference on CPU, kernels.triton_ops on GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch

from policyscan.kernels.reference import RopeCols, interleave_halves
from policyscan.kernels.spans import RankSpans, rank_spans


@dataclass(frozen=True)
class Prologue:
    """What runs before the GEMM on the activations: an RMSNorm (weight), or nothing."""

    norm_weight: torch.Tensor | None = None
    eps: float = 1e-6


@dataclass(frozen=True)
class LoraStack:
    """All adapters of one projection group: A [n, R, K], B [n, N, R] (scale folded into B)."""

    A: torch.Tensor
    B: torch.Tensor

    def __post_init__(self) -> None:
        n, r, _ = self.A.shape
        if self.B.shape[0] != n or self.B.shape[2] != r:
            raise ValueError(f"LoRA stack shapes disagree: A {tuple(self.A.shape)}, B {tuple(self.B.shape)}")


class DenseLoraLinear:
    """y = prologue(x) @ W.T (+ bias) + LoRA (+ residual), W in the compute dtype.

    silu_out: a fused gate/up projection whose rows are interleaved (interleave_halves) and whose output is
    silu(gate) * up; the LoRA B rows are interleaved the same way by set_lora. gelu: gelu_tanh(gate) * up
    instead (gemma2)."""

    quantized = False
    weight_scale: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prologue: Prologue, ops: ModuleType,
                 silu_out: bool = False, gelu: bool = False):
        self.weight, self.bias, self.prologue, self.ops, self.silu_out = weight, bias, prologue, ops, silu_out
        self.gelu = gelu and silu_out
        self.lora: LoraStack | None = None
        self.spans: RankSpans | None = None

    def set_lora(self, stack: LoraStack | None) -> None:
        """Attach all adapters' factors, B in the projection's natural row order. The ranks stack per group
        (q, k and v of rank-16 adapters: 3 x 16) with B block diagonal, so each column block's span of ranks is kept for
        the GEMM's expand (kernels/spans.py)."""
        if stack is not None and self.silu_out:
            stack = LoraStack(stack.A, interleave_halves(stack.B, dim=1).contiguous())
        self.lora = stack
        self.spans = rank_spans(stack.B) if stack is not None else None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, token_adapter: torch.Tensor, residual: torch.Tensor | None = None,
                 x_amax: torch.Tensor | None = None, rope: RopeCols | None = None, tma: bool = False) -> torch.Tensor:
        """x_amax: partial row maxima of |x| (|x * norm weight|) left by the kernel that wrote x, which an FP8
        prologue reads instead of sweeping x for its scale; rope: q and k heads of y rotated (RopeCols); tma: the
        prologue's kernel (kernels/prologue.py), the same rows up to the last bits of the scale and shrink."""
        return self._forward(x, token_adapter, residual, x_amax, False, None, rope, tma)

    def with_amax(self, x: torch.Tensor, token_adapter: torch.Tensor, residual: torch.Tensor | None = None,
                  x_amax: torch.Tensor | None = None, next_norm: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(y, partial row maxima of |y * next_norm| (or |y|)) for the next layer's FP8 prologue; at 16 bits
        no prologue quantizes, so (y, None)."""
        out = self._forward(x, token_adapter, residual, x_amax, self.quantized, next_norm)
        return out if self.quantized else (out, None)

    def split_rows(self, x: torch.Tensor, token_adapter: torch.Tensor, split: int, rows: torch.Tensor,
                   rows_adapter: torch.Tensor, x_amax: torch.Tensor | None = None,
                   rope: RopeCols | None = None, tma: bool = False) -> torch.Tensor:
        """y as __call__ gives it, but columns [:split] only at `rows` (whose adapters are rows_adapter; a row
        named twice must come with the same adapter, or which write wins is unspecified); those columns of the
        other rows are left unset. For the last layer's qkv: k and v are keys of every token, q only queries
        at each sequence's last one. Every row the GEMMs compute is bitwise what the whole product gives it
        (no output row depends on the batch: tests/test_invariance.py)."""
        if self.silu_out or not 0 < split < self.out_features:
            raise ValueError(f"split_rows needs a plain projection and 0 < split < {self.out_features}")
        h, h_scale, s = self._prologue(x, token_adapter, x_amax, tma)
        y = torch.empty(x.shape[0], self.out_features, dtype=x.dtype, device=x.device)
        w, ws, b, bias = self.weight, self.weight_scale, self.lora.B if self.lora else None, self.bias

        def cut(t: torch.Tensor | None, hi: bool, dim: int = 0) -> torch.Tensor | None:
            if t is None:
                return None
            return t.narrow(dim, split, t.shape[dim] - split) if hi else t.narrow(dim, 0, split)

        spans = self.spans
        rope_head, rope_tail = rope.split(split, rows) if rope is not None else (None, None)
        self.ops.lora_gemm(h, h_scale, cut(w, True), cut(ws, True), s, cut(b, True, 1), token_adapter,
                           cut(bias, True), None, x.dtype, out=y[:, split:],
                           spans=spans.narrow(split, self.out_features - split) if spans else None, rope=rope_tail)
        y[rows, :split] = self.ops.lora_gemm(
            _take(h, rows), _take(h_scale, rows), cut(w, False), cut(ws, False), _take(s, rows), cut(b, False, 1),
            rows_adapter, cut(bias, False), None, x.dtype, spans=spans.narrow(0, split) if spans else None,
            rope=rope_head)
        return y

    def _prologue(self, x: torch.Tensor, token_adapter: torch.Tensor, x_amax: torch.Tensor | None,
                  tma: bool = False):
        p, lora = self.prologue, self.lora
        return self.ops.prologue(x, p.norm_weight, p.eps, lora.A if lora else None, token_adapter, self.quantized,
                                 x_amax=x_amax, tma=tma)

    def _forward(self, x: torch.Tensor, token_adapter: torch.Tensor, residual: torch.Tensor | None,
                 x_amax: torch.Tensor | None, row_amax: bool, amax_weight: torch.Tensor | None,
                 rope: RopeCols | None = None, tma: bool = False):
        h, h_scale, s = self._prologue(x, token_adapter, x_amax, tma)
        return self.ops.lora_gemm(h, h_scale, self.weight, self.weight_scale, s, self.lora.B if self.lora else None,
                                  token_adapter, self.bias, residual, x.dtype, self.silu_out, row_amax=row_amax,
                                  amax_weight=amax_weight if row_amax else None, spans=self.spans, rope=rope,
                                  gelu=self.gelu)


def _take(t: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor | None:
    """t[rows]; an FP8 tensor through its bytes, since index kernels do not cover float8 on every backend."""
    if t is None:
        return None
    return t.view(torch.uint8)[rows].view(t.dtype) if t.dtype == torch.float8_e4m3fn else t[rows]


class Fp8LoraLinear(DenseLoraLinear):
    """W8A8: e4m3 weight [N, K] with per-output-channel scales; activations quantized per token in the prologue
    (the RMSNorm folded into the row scale: kernels/prologue.py). The LoRA shrink reads the 16-bit activations,
    never the FP8 ones."""

    quantized = True

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 prologue: Prologue, ops: ModuleType, silu_out: bool = False, gelu: bool = False):
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8LoraLinear needs an e4m3 weight, got {weight.dtype}")
        super().__init__(weight, bias, prologue, ops, silu_out, gelu)
        self.weight_scale = weight_scale.float().reshape(-1)

    def set_lora(self, stack: LoraStack | None) -> None:
        """As DenseLoraLinear, with the RMSNorm's weight folded into A: the quantizing prologue's shrink is
        rstd * x @ (A * w).T (kernels/prologue.py), which reads x as loaded."""
        super().set_lora(stack)
        w = self.prologue.norm_weight
        if self.lora is not None and w is not None:
            A = self.lora.A
            self.lora = LoraStack((A.float() * w.float().to(A.device)).to(A.dtype), self.lora.B)
