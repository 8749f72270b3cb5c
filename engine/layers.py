"""Linear layers with stacked multi-LoRA. Each is two kernels: a prologue over the activations, then one GEMM.

Quantization is a swap of the layer class at load time (`DenseLoraLinear` or `Fp8LoraLinear`): the decoder
never branches on precision. `ops` is the kernel set (kernels.reference on CPU, kernels.triton_ops on GPU).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch


@dataclass(frozen=True)
class Prologue:
    """What runs before the GEMM on the activations: an RMSNorm (weight), SiLU-and-mul, or nothing."""

    norm_weight: torch.Tensor | None = None
    eps: float = 1e-6
    silu_mul: bool = False

    def __post_init__(self) -> None:
        if self.norm_weight is not None and self.silu_mul:
            raise ValueError("a prologue is an RMSNorm or a SiLU-and-mul, not both")


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
    """y = prologue(x) @ W.T (+ bias) + LoRA (+ residual), W in the compute dtype."""

    quantized = False
    weight_scale: torch.Tensor | None = None

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, prologue: Prologue, ops: ModuleType):
        self.weight, self.bias, self.prologue, self.ops = weight, bias, prologue, ops
        self.lora: LoraStack | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def __call__(self, x: torch.Tensor, token_adapter: torch.Tensor,
                 residual: torch.Tensor | None = None) -> torch.Tensor:
        p, lora = self.prologue, self.lora
        h, h_scale, s = self.ops.prologue(x, p.norm_weight, p.eps, p.silu_mul,
                                          lora.A if lora else None, token_adapter, self.quantized)
        return self.ops.lora_gemm(h, h_scale, self.weight, self.weight_scale, s, lora.B if lora else None,
                                  token_adapter, self.bias, residual, x.dtype)


class Fp8LoraLinear(DenseLoraLinear):
    """W8A8: e4m3 weight [N, K] with per-output-channel scales; activations quantized per token in the prologue.
    The LoRA shrink reads the 16-bit activations, never the FP8 ones."""

    quantized = True

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor | None,
                 prologue: Prologue, ops: ModuleType):
        if weight.dtype != torch.float8_e4m3fn:
            raise ValueError(f"Fp8LoraLinear needs an e4m3 weight, got {weight.dtype}")
        super().__init__(weight, bias, prologue, ops)
        self.weight_scale = weight_scale.float().reshape(-1)
