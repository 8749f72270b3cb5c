"""The GPU kernel set: the same functions as kernels.reference, backed by Triton where it pays."""
from __future__ import annotations

from policyscan.kernels.attention import varlen_attention
from policyscan.kernels.head import head
from policyscan.kernels.lora_gemm import lora_gemm
from policyscan.kernels.prologue import prologue

__all__ = ["head", "lora_gemm", "prologue", "varlen_attention"]
