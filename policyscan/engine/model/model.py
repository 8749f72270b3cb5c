"""The decoder (Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Granite) over packed multi-LoRA batches; f from two
tokens."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch

from policyscan.engine.model.config import ModelConfig, inv_freq
from policyscan.engine.model.layers import DenseLoraLinear
from policyscan.engine.model.precision import Precision
from policyscan.engine.run.batch import PackedBatch, pack
from policyscan.kernels.reference import AttnShape, PrefixKV, RopeCols, rope_tables


@dataclass
class DecoderLayer:
    qkv: DenseLoraLinear       # prologue: input RMSNorm
    o: DenseLoraLinear         # + residual
    gate_up: DenseLoraLinear   # prologue: post-attention RMSNorm; epilogue: SiLU-and-mul
    down: DenseLoraLinear      # + residual
    q_norm: torch.Tensor | None = None  # Qwen3 and gemma3 per-head norms
    k_norm: torch.Tensor | None = None
    post_attn_norm: torch.Tensor | None = None  # gemma2/3: o's output normed before its residual add
    post_mlp_norm: torch.Tensor | None = None   # gemma2/3: down's output normed before its residual add


class Decoder:
    """Embeddings, layers, final norm, and per-policy head vectors W[Violation] - W[Compliant]."""

    def __init__(self, cfg: ModelConfig, precision: Precision, embed: torch.Tensor, layers: list[DecoderLayer],
                 norm: torch.Tensor, ops: ModuleType, head_rows: Callable[[list[int]], torch.Tensor]):
        if embed.dtype != precision.dtype:
            raise ValueError(f"the embeddings are {embed.dtype}, the precision computes in {precision.dtype}")
        self.cfg, self.precision, self.embed, self.layers, self.norm = cfg, precision, embed, layers, norm
        self.ops = ops
        self.head_rows = head_rows  # label ids -> rows of the output projection (fp32)
        self.head: torch.Tensor | None = None  # [n_policies, hidden] fp32, set by attach_policies
        self._rope_cache: tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def dtype(self) -> torch.dtype:
        return self.precision.dtype

    def rope_tables(self, max_pos: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """cos/sin [n P, head_dim/2] fp32: P positions (P >= max_pos) of each of the n rotary embeddings of
        cfg.ropes (gemma3's sliding layers have their own) one after the other, computed in fp64, rounded to fp16
        and packed where the precision says so (Precision.packed_rope). Grown on demand. One tensor each, so that
        whoever keeps the tables alive (a CUDA graph) keeps every layer's; layer_rope cuts a layer's rows out."""
        if self._rope_cache is None or self._rope_cache[0] < max_pos:
            size = max(max_pos, 4096)
            pos = torch.arange(size, dtype=torch.float64)
            ang = torch.cat([torch.outer(pos, inv_freq(self.cfg, r)) for r in self.cfg.ropes])
            # on the CPU, then moved: the same bits on every device
            tables = rope_tables(ang, packed=self.precision.packed_rope)
            self._rope_cache = (size, *(t.to(self.device) if t is not None else None for t in tables))
        return self._rope_cache[1:]

    def layer_rope(self, tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None], layer: int
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """One layer's cos/sin (and packed) rows of rope_tables' tables: views, contiguous."""
        n = len(self.cfg.ropes)
        if n == 1:
            return tables
        P, k = tables[0].shape[0] // n, self.cfg.rope_index(layer)
        return tuple(t[k * P:(k + 1) * P] if t is not None else None for t in tables)

    def forward(self, batch: PackedBatch, prefix: PrefixCache | None = None,
                capture: list[torch.Tensor] | None = None) -> torch.Tensor:
        """f [B] (fp32): logit(Violation) - logit(Compliant) at each sequence's last token.

        prefix: cached per-policy prefixes every sequence attends to first (its tokens then start after it).
        capture: receives each layer's qkv rows (how a prefix cache is made)."""
        cfg, ops = self.cfg, self.ops
        if self.head is None:
            raise RuntimeError("no policies attached: call attach_policies first")
        seq_pre = None
        if prefix is not None:
            ad = batch.seq_adapter.long()
            seq_pre = (prefix.start[ad], prefix.length[ad])
        tables = self.rope_tables(batch.max_seqlen + (prefix.longest if prefix is not None else 0))
        shape = AttnShape(cfg.heads, cfg.kv_heads, cfg.head_dim)
        positions = batch.positions
        if prefix is not None:  # a sequence's own tokens start after its policy's cached prefix
            positions = positions + prefix.length[batch.token_adapter.long()]
        # q and k are normed and rotated by the qkv GEMM as it writes them (a cached prefix keeps rotated keys),
        # so the attention reads them as they are: no rope pass, no rotation inside the attention
        # (kernels/gluon_rope.py; faster end to end than a rope pass: docs/performance.md).
        q_cols, D = cfg.heads * cfg.head_dim, cfg.head_dim
        h = self.embed[batch.ids]
        h_amax = None  # partial row maxima of |h * next norm weight|: see below
        tok_ad, last = batch.token_adapter, batch.last_idx
        for i, layer in enumerate(self.layers):
            # The last layer only needs each sequence's last token past the K/V projections, q included: exact
            # pruning (q is most of the qkv GEMM's columns).
            last_only = i == len(self.layers) - 1
            cos, sin, packed = self.layer_rope(tables, i)
            rope = RopeCols(positions, cos, sin, D, q_cols + cfg.kv_heads * D, q_cols, layer.q_norm, layer.k_norm,
                            cfg.rms_eps, packed)
            # qkv's prologue streams x by TMA (kernels/gluon_prologue.py), the other three do not: at the 700 W
            # cap the faster prologue's power spike slows the GEMM after it, which the short qkv GEMM (and the
            # attention after it) absorb and gate_up's does not (on qkv alone a gain, on all four a loss:
            # docs/performance.md)
            if last_only:  # each row's own adapter: a padded batch's empty sequences repeat a last index
                qkv = layer.qkv.split_rows(h, tok_ad, q_cols, last, tok_ad[last], x_amax=h_amax, rope=rope, tma=True)
            else:
                qkv = layer.qkv(h, tok_ad, x_amax=h_amax, rope=rope, tma=True)
            if capture is not None:  # a cached prefix is read as rotated keys at its own positions, never as
                # queries (the last layer's q is set at last tokens only)
                capture.append(qkv)
            pkv = PrefixKV(prefix.layers[i], *seq_pre) if prefix is not None else None
            # Every kernel that writes a projection's input also leaves its row maxima (times the next norm's
            # weight), so that no FP8 prologue sweeps its input for the scale: each reads it once. At 16 bits
            # no prologue quantizes: only the attention's, which costs nothing, is computed, and left unused.
            attn, attn_amax = ops.varlen_attention(qkv, batch.cu_seqlens, shape, cfg.scale, cfg.window(i),
                                                   last_only=last_only, prefix=pkv, row_amax=True,
                                                   softcap=cfg.attn_softcap)
            if last_only:
                h, tok_ad = h[last], batch.seq_adapter
            if cfg.gemma:
                h = self._sandwich_branches(layer, attn, attn_amax, h, tok_ad)
            else:
                h, h_amax = self._branches(i, layer, attn, attn_amax, h, h_amax, tok_ad)
        return ops.head(h, self.norm, cfg.rms_eps, self.head, batch.seq_adapter, softcap=cfg.final_softcap)

    def _branches(self, i: int, layer: DecoderLayer, attn: torch.Tensor, attn_amax: torch.Tensor | None,
                  h: torch.Tensor, h_amax: torch.Tensor | None, tok_ad: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """o and the MLP, each adding its residual in the GEMM's epilogue; returns h and its row maxima."""
        h, h_amax = layer.o.with_amax(attn, tok_ad, residual=h, x_amax=attn_amax,
                                      next_norm=layer.gate_up.prologue.norm_weight)
        act, act_amax = layer.gate_up.with_amax(h, tok_ad, x_amax=h_amax)
        if i == len(self.layers) - 1:  # the final norm is no prologue
            return layer.down(act, tok_ad, residual=h, x_amax=act_amax), None
        return layer.down.with_amax(act, tok_ad, residual=h, x_amax=act_amax,
                                    next_norm=self.layers[i + 1].qkv.prologue.norm_weight)

    def _sandwich_branches(self, layer: DecoderLayer, attn: torch.Tensor, attn_amax: torch.Tensor | None,
                           h: torch.Tensor, tok_ad: torch.Tensor) -> torch.Tensor:
        """gemma2's and gemma3's o and MLP, each branch's output normed before its residual add: a norm no GEMM epilogue
        can apply, so o and down write the branch alone and a 16-bit norm prologue (no LoRA) then adds it.
        The next prologues find their FP8 scales by a sweep (no row maxima are passed on)."""
        h = self._norm_add(layer.o(attn, tok_ad, x_amax=attn_amax), layer.post_attn_norm, h, tok_ad)
        return self._norm_add(layer.down(layer.gate_up(h, tok_ad), tok_ad), layer.post_mlp_norm, h, tok_ad)

    def _norm_add(self, y: torch.Tensor, weight: torch.Tensor, residual: torch.Tensor,
                  tok_ad: torch.Tensor) -> torch.Tensor:
        """residual + rmsnorm(y), the norm rounded to y's dtype and the sum rounded again, as HF does."""
        return self.ops.prologue(y, weight, self.cfg.rms_eps, None, tok_ad, False)[0] + residual

    def prefill_prefixes(self, prefixes: list[list[int]]) -> PrefixCache | None:
        """Run each policy's fixed prompt head ([BOS] + prefix) once with its adapter and keep every layer's
        qkv rows; None when no policy has one."""
        present = [i for i, ids in enumerate(prefixes) if ids]
        if not present:
            return None
        batch = pack([prefixes[i] for i in present], present).to(self.device)
        layers: list[torch.Tensor] = []
        self.forward(batch, capture=layers)
        start = torch.zeros(len(prefixes), dtype=torch.int32)
        length = torch.zeros(len(prefixes), dtype=torch.int32)
        start[present] = batch.cu_seqlens[:-1].cpu()
        length[present] = torch.tensor([len(prefixes[i]) for i in present], dtype=torch.int32)
        return PrefixCache(layers, start.to(self.device), length.to(self.device), int(length.max()))


@dataclass(frozen=True)
class PrefixCache:
    """Every layer's qkv rows for the policies' prompt heads; policy i owns rows start[i] : start[i]+length[i]."""

    layers: list[torch.Tensor]
    start: torch.Tensor   # [n_policies] int32
    length: torch.Tensor  # [n_policies] int32
    longest: int
