"""The two-token head of each sequence's last token: the final RMSNorm, then one dot product with its policy's
W[Violation] - W[Compliant].

Semantics: reference.head — hn = rmsnorm(h, w, eps) rounded to h's dtype, f = (hn.float() * head[ad]).sum(-1)
in fp32; f = 0 for an adapter of -1 (a padding sequence).
Why a kernel: torch's row reduction picks its strategy by the number of rows, so a sequence's f moved in its last
bits with the batch's sequence count (bench/determinism.py kernels: 24 of 48 values across 7 batch sizes). One
program a row, one fixed reduction order: f depends on its row alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _head_kernel(h_ptr, w_ptr, head_ptr, ad_ptr, f_ptr, H, stride_h, stride_head, eps, BH: tl.constexpr):
    row = tl.program_id(0)
    rk = tl.arange(0, BH)
    ok = rk < H
    x = tl.load(h_ptr + row * stride_h + rk, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + rk, mask=ok, other=0.0).to(tl.float32)
    hn = (x * rstd * w).to(h_ptr.dtype.element_ty).to(tl.float32)
    ad = tl.load(ad_ptr + row)
    v = tl.load(head_ptr + tl.maximum(ad, 0) * stride_head + rk, mask=rk < tl.where(ad >= 0, H, 0), other=0.0)
    tl.store(f_ptr + row, tl.sum(hn * v, axis=0))


def head(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, head_rows: torch.Tensor,
         seq_adapter: torch.Tensor) -> torch.Tensor:
    """Launcher; same semantics as reference.head. h [B, H] (16- or 32-bit), norm_weight [H], head_rows
    [n_policies, H] fp32, seq_adapter [B] int32 (-1: padding) -> f [B] fp32."""
    B, H = h.shape
    if h.stride(1) != 1 or norm_weight.shape != (H,) or head_rows.dim() != 2 or head_rows.shape[1] != H:
        raise ValueError(f"h {tuple(h.shape)}, norm weight {tuple(norm_weight.shape)} and head "
                         f"{tuple(head_rows.shape)} do not fit")
    if head_rows.dtype != torch.float32 or head_rows.stride(1) != 1:
        raise ValueError("head rows must be fp32 with a contiguous last dimension")
    if seq_adapter.dtype != torch.int32 or seq_adapter.shape != (B,):
        raise ValueError(f"seq_adapter must be int32 [{B}]")
    f = torch.empty(B, dtype=torch.float32, device=h.device)
    if B:
        BH = triton.next_power_of_2(H)
        _head_kernel[(B,)](h, norm_weight, head_rows, seq_adapter, f, H, h.stride(0), head_rows.stride(0), eps,
                           BH=BH, num_warps=8 if BH >= 2048 else 4)
    return f
