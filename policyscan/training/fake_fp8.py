"""FP8 scoring's numerics for training (--precision fp8): each base projection of the decoder swapped, at load,
for one whose weight is FP8 scoring's (e4m3 per output channel, engine/model/quant.py) and whose input is
quantized per token to e4m3 in the forward pass, as the prologue quantizes it. Gradients pass the activation
quantizer straight through; the LoRA path reads the unquantized input and stays in full precision, as the
engine's LoRA shrink does."""
from __future__ import annotations

import torch
from torch import nn

from policyscan.engine.model.config import PROJECTIONS
from policyscan.engine.model.quant import dequantize_weight, quantize_weight
from policyscan.kernels.reference import quantize_rows


class FakeFp8Linear(nn.Module):
    """y = dequant(quant_rows(x)) @ dequant(W8).T in the input's dtype: the W8A8 GEMM's rounding, fake-quantized.

    Semantics: x8, sx = quantize_rows(x); y = (x8.float() * sx[:, None]) @ (W8.float() * sw[:, None]).T."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("a projection with a bias has no FP8 path in the engine")
        w8, scale = quantize_weight(linear.weight.detach())
        self.register_buffer("weight", dequantize_weight(w8, scale, linear.weight.dtype), persistent=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x8, scale = quantize_rows(rows.detach())
        xq = (x8.float() * scale[:, None]).to(x.dtype)
        xq = rows + (xq - rows).detach()  # straight through: d(xq)/dx = 1
        return torch.nn.functional.linear(xq, self.weight).reshape(*x.shape[:-1], self.out_features)


def swap_projections(causal: nn.Module) -> int:
    """Every decoder layer's seven projections' base Linear replaced by a FakeFp8Linear (under a PEFT LoRA
    layer its base_layer); returns how many were swapped."""
    swapped = 0
    for layer in causal.model.layers:
        for block in (layer.self_attn, layer.mlp):
            for name in PROJECTIONS:
                module = getattr(block, name, None)
                if module is None:
                    continue
                owner, attr = (module, "base_layer") if hasattr(module, "base_layer") else (block, name)
                setattr(owner, attr, FakeFp8Linear(getattr(owner, attr)))
                swapped += 1
    return swapped
