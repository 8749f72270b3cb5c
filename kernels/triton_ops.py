"""The GPU kernel set: the same functions as kernels.reference, backed by Triton where it pays."""
from __future__ import annotations

from .attention import varlen_attention
from .head import head
from .lora_gemm import lora_gemm
from .prologue import prologue

__all__ = ["head", "lora_gemm", "prologue", "varlen_attention"]
