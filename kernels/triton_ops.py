"""The GPU kernel set: the same functions as kernels.reference, backed by Triton where it pays."""
from __future__ import annotations

from .attention import varlen_attention
from .lora_gemm import lora_gemm
from .prologue import prologue
from .reference import rmsnorm  # the final norm, on last tokens only: small, left to torch

__all__ = ["lora_gemm", "prologue", "rmsnorm", "varlen_attention"]
