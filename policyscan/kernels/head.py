"""The two-token head of each sequence's last token: the final RMSNorm, then one dot product with its policy's
W[Violation] - W[Compliant].

Semantics: reference.head — hn = rmsnorm(h, w, eps) rounded to h's dtype, f = (hn.float() * head[ad]).sum(-1)
in fp32; f = 0 for an adapter of -1 (a padding sequence). With softcap, head[ad] is the two rows W[Violation],
W[Compliant] and f = cap * tanh(l_v / cap) - cap * tanh(l_c / cap) of their dot products (gemma2).
Why a kernel: torch's row reduction picks its strategy by the number of rows, so a sequence's f moved in its last
bits with the batch's sequence count (bench/determinism.py kernels: 24 of 48 values across 7 batch sizes). One
program a row, one fixed reduction order: f depends on its row alone.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from policyscan.kernels.fast_math import tanh
from policyscan.kernels.tuning import head_warps


@triton.jit
def _head_kernel(h_ptr, w_ptr, head_ptr, ad_ptr, f_ptr, H, stride_h, stride_head, eps, cap,
                 BH: tl.constexpr, SOFTCAP: tl.constexpr, LIB: tl.constexpr):
    row = tl.program_id(0)
    rk = tl.arange(0, BH)
    ok = rk < H
    x = tl.load(h_ptr + row * stride_h + rk, mask=ok, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + rk, mask=ok, other=0.0).to(tl.float32)
    hn = (x * rstd * w).to(h_ptr.dtype.element_ty).to(tl.float32)
    ad = tl.load(ad_ptr + row)
    row_ptr = head_ptr + tl.maximum(ad, 0) * stride_head
    live = rk < tl.where(ad >= 0, H, 0)
    v = tl.load(row_ptr + rk, mask=live, other=0.0)
    if SOFTCAP:  # row_ptr holds W[Violation] then W[Compliant], H apart
        c = tl.load(row_ptr + H + rk, mask=live, other=0.0)
        f = cap * tanh(tl.sum(hn * v, axis=0) / cap, LIB) - cap * tanh(tl.sum(hn * c, axis=0) / cap, LIB)
        tl.store(f_ptr + row, f)
    else:
        tl.store(f_ptr + row, tl.sum(hn * v, axis=0))


def head(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, head_rows: torch.Tensor,
         seq_adapter: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Launcher; same semantics as reference.head. h [B, H] (16- or 32-bit), norm_weight [H], head_rows
    [n_policies, H] fp32 ([n_policies, 2, H] contiguous with softcap), seq_adapter [B] int32 (-1: padding)
    -> f [B] fp32."""
    B, H = h.shape
    if softcap is not None:
        if head_rows.shape[1:] != (2, H) or not head_rows.is_contiguous() or not softcap > 0:
            raise ValueError(f"a soft-capped head needs contiguous [n, 2, {H}] rows and a positive cap")
        head_rows = head_rows.view(head_rows.shape[0], 2 * H)
    elif head_rows.dim() != 2 or head_rows.shape[1] != H:
        raise ValueError(f"head rows {tuple(head_rows.shape)} do not fit width {H}")
    if h.stride(1) != 1 or norm_weight.shape != (H,):
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
                           softcap or 1.0, BH=BH, SOFTCAP=softcap is not None, LIB=h.device.type != "cpu",
                           num_warps=head_warps(BH))
    return f
