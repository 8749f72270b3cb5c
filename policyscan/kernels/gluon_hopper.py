"""Gluon's Hopper API across Triton versions, for the warp-specialized GEMM (lora_gemm_ws.py).

The device runs Triton 3.6 and the CPU machine 3.9 (where the kernel is compiled for sm_90a to check its
registers): TMA copies and warp_specialize are spelled differently between them.
"""
from __future__ import annotations

import functools
import inspect

from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import tma

# warp_specialize takes a list of (fn, args) from Triton 3.6 on (the device's version); the earlier form was
# never run here, so such a Triton counts as one without this kernel (kernels.lora_gemm falls back).
if "functions_and_args" not in inspect.signature(gl.warp_specialize).parameters:
    raise ImportError("lora_gemm_ws needs Gluon's warp_specialize(functions_and_args, ...) (Triton 3.6 or later)")

# TMA copies: Triton 3.6 names them async_copy_global_to_shared / async_copy_shared_to_global, later
# versions async_load / async_store (and remove the old names).
tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
tma_store = getattr(tma, "async_store", None) or tma.async_copy_shared_to_global


@functools.lru_cache(maxsize=None)
def smem_layout(rows: int, cols: int, fp8: bool) -> gl.NVMMASharedLayout:
    """The swizzled shared-memory layout of a [rows, cols] FP8 (or bf16) TMA block."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.float8e4nv if fp8 else gl.bfloat16)
