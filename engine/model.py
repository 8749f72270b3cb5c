"""The decoder (Llama / Mistral / Qwen2 / Qwen3) over packed multi-LoRA batches, reading f from two tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from .batch import PackedBatch
from .config import ModelConfig, inv_freq
from .layers import DenseLoraLinear


@dataclass
class DecoderLayer:
    qkv: DenseLoraLinear       # prologue: input RMSNorm
    o: DenseLoraLinear         # + residual
    gate_up: DenseLoraLinear   # prologue: post-attention RMSNorm
    down: DenseLoraLinear      # prologue: SiLU-and-mul; + residual
    q_norm: torch.Tensor | None = None  # Qwen3 per-head norms
    k_norm: torch.Tensor | None = None


class Decoder:
    """Embeddings, layers, final norm, and per-policy head vectors W[Violation] - W[Compliant]."""

    def __init__(self, cfg: ModelConfig, embed: torch.Tensor, layers: list[DecoderLayer], norm: torch.Tensor,
                 ops: ModuleType, head_rows: Callable[[list[int]], torch.Tensor]):
        self.cfg, self.embed, self.layers, self.norm, self.ops = cfg, embed, layers, norm, ops
        self.head_rows = head_rows  # label ids -> rows of the output projection (fp32)
        self.head: torch.Tensor | None = None  # [n_policies, hidden] fp32, set by attach_policies
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.dtype

    def rope(self, positions: torch.Tensor, max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim/2] in fp32 (computed in fp64 once per table size)."""
        if self._rope_cache is None or self._rope_cache[0] < max_pos:
            size = max(max_pos, 4096)
            ang = torch.outer(torch.arange(size, dtype=torch.float64), inv_freq(self.cfg))
            self._rope_cache = (size, ang.cos().float().to(self.device), ang.sin().float().to(self.device))
        _, cos, sin = self._rope_cache
        return cos[positions], sin[positions]

    def forward(self, batch: PackedBatch) -> torch.Tensor:
        """f [B] (fp32): logit(Violation) - logit(Compliant) at each sequence's last token."""
        cfg, ops = self.cfg, self.ops
        if self.head is None:
            raise RuntimeError("no policies attached: call attach_policies first")
        cos, sin = self.rope(batch.positions, batch.max_seqlen)
        h = self.embed[batch.ids]
        tok_ad, last = batch.token_adapter, batch.last_idx
        for i, layer in enumerate(self.layers):
            # The last layer only needs each sequence's last token past the K/V projections: exact pruning.
            last_only = i == len(self.layers) - 1
            qkv = layer.qkv(h, tok_ad)
            q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
            q = q.reshape(-1, cfg.heads, cfg.head_dim)
            k = k.reshape(-1, cfg.kv_heads, cfg.head_dim)
            v = v.reshape(-1, cfg.kv_heads, cfg.head_dim)
            if layer.q_norm is not None:
                q = ops.rmsnorm(q, layer.q_norm, cfg.rms_eps)
                k = ops.rmsnorm(k, layer.k_norm, cfg.rms_eps)
            if last_only:
                q, q_cos, q_sin = q[last], cos[last], sin[last]
            else:
                q_cos, q_sin = cos, sin
            q, k = apply_rope(q, q_cos, q_sin), apply_rope(k, cos, sin)
            attn = ops.varlen_attention(q, k, v, batch.cu_seqlens, cfg.head_dim ** -0.5,
                                        cfg.sliding_window, last_only=last_only, max_seqlen=batch.max_seqlen)
            if last_only:
                h, tok_ad = h[last], batch.seq_adapter
            h = layer.o(attn.reshape(h.shape[0], -1), tok_ad, residual=h)
            h = layer.down(layer.gate_up(h, tok_ad), tok_ad, residual=h)
        hn = ops.rmsnorm(h, self.norm, cfg.rms_eps).float()
        return (hn * self.head[batch.seq_adapter.long()]).sum(-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (HF layout) in fp32; x [T, heads, D], cos/sin [T, D/2]."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)
