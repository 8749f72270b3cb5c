"""Torch twins of the Triton kernels: same signatures, same rounding points; the CPU engine runs on these.

Conventions shared with the kernels:
- `token_adapter` [T] int32: the adapter of each token's sequence, -1 for none.
- LoRA stacks: A [n, R, K], B [n, N, R] with the scale folded into B. `s = x @ A[a].T` is kept in fp32 and
  rounded to the compute dtype right before the expand (tensor cores take 16-bit operands).
- Accumulation in fp32 (fp64 when the inputs are fp64: the tests' exact reference); one rounding to the
  output dtype at the end.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .spans import RankSpans

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


ROW_BLOCK = 16  # rows per block in the CPU twins' batch-invariant products and elementwise ops


def rows_matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T where each row's result does not depend on the other rows (batch invariance on the CPU).

    A plain CPU matmul does depend on them: a 1-row product takes another kernel than a 37-row one, and
    the needle test saw f differ in 20 of 20 batches (fp32). Fixed 16-row blocks in one bmm give every row
    the same kernel and reduction order; outputs narrower than 16 columns (the LoRA shrink) go through an
    elementwise product and a sum over K instead, since a blocked GEMM that narrow still moved with the
    row's place in its block (K=33, N=7)."""
    M, K = x.shape
    if w.shape[0] < ROW_BLOCK:
        out = torch.empty(M, w.shape[0], dtype=x.dtype, device=x.device)
        step = max(1, (1 << 22) // max(1, w.numel()))  # bound the [rows, N, K] temporary to ~4M elements
        for i in range(0, M, step):
            out[i:i + step] = (x[i:i + step, None, :] * w[None]).sum(-1)
        return out
    pad = (-M) % ROW_BLOCK
    xp = torch.cat([x, x.new_zeros(pad, K)]) if pad else x
    return (xp.reshape(-1, ROW_BLOCK, K) @ w.T).reshape(-1, w.shape[0])[:M]


def row_blocks(fn, x: torch.Tensor) -> torch.Tensor:
    """fn over fixed 16-row blocks. CPU elementwise kernels split work by the tensor's size (threads,
    vector tails), and transcendental functions (exp, rsqrt) take another code path in a tail: with
    SiLU on whole batches, f moved in the last bits for 3 of 400 prompts when the batch size changed."""
    M = x.shape[0]
    pad = (-M) % ROW_BLOCK
    xp = torch.cat([x, x.new_zeros((pad,) + x.shape[1:])]) if pad else x
    return torch.cat([fn(xp[i:i + ROW_BLOCK]) for i in range(0, xp.shape[0], ROW_BLOCK)])[:M]


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: (x / sqrt(mean(x^2) + eps)) * weight, in fp32, rounded to x.dtype."""
    def norm(xb: torch.Tensor) -> torch.Tensor:
        xf = xb.to(_acc(xb))
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)).to(x.dtype)
    return row_blocks(norm, x)


def head(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, head_rows: torch.Tensor,
         seq_adapter: torch.Tensor) -> torch.Tensor:
    """Semantics: f = (rmsnorm(h, w, eps).float() * head_rows[seq_adapter]).sum(-1), fp32; 0 for adapter -1."""
    ad = seq_adapter.long()
    rows = head_rows[ad.clamp(min=0)] * (ad >= 0)[:, None]
    return (rmsnorm(h, norm_weight, eps).float() * rows).sum(-1)


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: x8 = x / scale with scale = amax(|row|) / 448, at least 2^-126 (the smallest
    normal fp32, whose reciprocal the GPU prologue multiplies by), and 1 for an all-zero row; `amax` [M], when
    given, is that row maximum already known."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True) if amax is None else amax.float()[:, None]
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny),
                        torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def lora_shrink(x: torch.Tensor, A: torch.Tensor, token_adapter: torch.Tensor) -> torch.Tensor:
    """Semantics: s[t] = x[t] @ A[token_adapter[t]].T in fp32 (zeros where token_adapter is -1)."""
    s = torch.zeros(x.shape[0], A.shape[1], dtype=_acc(x), device=x.device)
    for a in torch.unique(token_adapter).tolist():  # a loop over adapters present, never over tokens
        if a < 0:
            continue
        rows = (token_adapter == a).nonzero().squeeze(1)
        s[rows] = rows_matmul(x[rows].to(s.dtype), A[a].to(s.dtype))
    return s


def prologue(x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, A: torch.Tensor | None,
             token_adapter: torch.Tensor, quant: bool, x_amax: torch.Tensor | None = None, tma: bool = False
             ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Semantics: h = rmsnorm(x) if norm_weight is given else x, rounded to x.dtype;
    returns (h, None, lora_shrink(h, A) or None) — or, quantizing, the same product in FP8 with the norm
    folded into the row scale: u = x * w (exact in fp32), (u8, scale) = quantize_rows(u),
    returns (u8, scale * rstd, rstd * lora_shrink(x, A)), rstd = 1/sqrt(mean(x^2) + eps), where A carries the
    norm's weight (A * w, rounded once: layers.Fp8LoraLinear folds it when the adapters are attached).
    Then the scale is known before the norm's sum of squares, so the kernel sweeps x once, and its shrink
    reads x as loaded.
    s is rounded to A's dtype, the expand's operand dtype (lora_gemm rounds s to B's, which is A's): the
    rounding the GEMM did, done once where s is written, so every GEMM tile reads half the bytes for the same
    bits (W1 +0.67%, f bitwise the same, run 143).
    x_amax: partial row maxima of |u| [P, M] from the kernel that wrote x (row_amax of lora_gemm and
    varlen_attention): their max is amax(|u|) exactly, so it replaces the quantizer's own sweep. tma picks how
    the GPU kernel streams x (kernels/prologue.py); the semantics are the same, so it is ignored here."""
    if not quant:
        h = rmsnorm(x, norm_weight, eps) if norm_weight is not None else x
        return h, None, lora_shrink(h, A, token_adapter).to(A.dtype) if A is not None else None
    u = x.to(_acc(x)) * norm_weight.to(_acc(x)) if norm_weight is not None else x
    u8, scale = quantize_rows(u, x_amax.amax(0) if x_amax is not None else None)
    s = lora_shrink(x, A, token_adapter) if A is not None else None
    if norm_weight is not None:
        rstd = row_blocks(lambda xb: torch.rsqrt(xb.to(_acc(xb)).pow(2).mean(-1, keepdim=True) + eps), x).squeeze(-1)
        scale = scale * rstd
        s = s * rstd[:, None] if s is not None else None
    return u8, scale, s.to(A.dtype) if s is not None else None


def amax_parts(y: torch.Tensor) -> torch.Tensor:
    """Partial row maxima [1, M] of |y| as the kernels write them (one partial: the whole row)."""
    return y.float().abs().amax(-1)[None] if y.shape[-1] else y.new_zeros((1, y.shape[0]), dtype=torch.float32)


def lora_gemm(x: torch.Tensor, x_scale: torch.Tensor | None, W: torch.Tensor, w_scale: torch.Tensor | None,
              s: torch.Tensor | None, B: torch.Tensor | None, token_adapter: torch.Tensor,
              bias: torch.Tensor | None, residual: torch.Tensor | None, out_dtype: torch.dtype,
              silu_out: bool = False, out: torch.Tensor | None = None, row_amax: bool = False,
              amax_weight: torch.Tensor | None = None, spans: RankSpans | None = None,
              rope: RopeCols | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Semantics: y = (x @ W.T) * (x_scale[:, None] * w_scale[None, :]) + s.to(dtype) @ B[adapter].T
    (+ bias) (+ residual), accumulated in fp32, rounded once to out_dtype. W is [N, K].
    silu_out: W's rows alternate gate, up (interleave_halves); y = silu(y[:, 0::2]) * y[:, 1::2], [M, N/2].
    out: written in place (a view, e.g. some columns of a wider tensor) and returned.
    row_amax: also return partial row maxima of |y| [P, M], of |y * amax_weight| when given (prologue's x_amax).
    spans: where B can be nonzero (kernels.spans); it changes no result, so the twin takes every rank.
    rope: q and k heads of y rotated (RopeCols, rope_cols) after its rounding; a plain output only."""
    if rope is not None and (silu_out or row_amax):
        raise ValueError("rope applies to a plain projection's output (no SiLU epilogue, no row maxima)")
    if out is not None:  # as the GPU launcher: out filled, and the row maxima too when asked for
        res = lora_gemm(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, out_dtype, silu_out,
                        row_amax=row_amax, amax_weight=amax_weight, rope=rope)
        out.copy_(res[0] if row_amax else res)
        return (out, res[1]) if row_amax else out
    if row_amax:
        y = lora_gemm(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, out_dtype, silu_out)
        return y, amax_parts(y if amax_weight is None else y.float() * amax_weight.float())
    dt = torch.float64 if torch.float64 in (out_dtype, W.dtype) else torch.float32
    acc = rows_matmul(x.to(dt), W.to(dt))
    if x_scale is not None:
        acc = acc * (x_scale.to(dt)[:, None] * w_scale.to(dt)[None, :])
    if s is not None:
        lo = s.to(B.dtype).to(dt)
        for a in torch.unique(token_adapter).tolist():
            if a < 0:
                continue
            rows = (token_adapter == a).nonzero().squeeze(1)
            acc[rows] += rows_matmul(lo[rows], B[a].to(dt))
    if bias is not None:
        acc = acc + bias.to(dt)
    if residual is not None:
        acc = acc + residual.to(dt)
    if silu_out:
        return row_blocks(lambda a: (F.silu(a[:, 0::2]) * a[:, 1::2]).to(out_dtype), acc)
    y = acc.to(out_dtype)
    return rope_cols(y, rope) if rope is not None else y


def interleave_halves(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """[g0 .. g(I-1), u0 .. u(I-1)] -> [g0, u0, g1, u1, ...] along dim: the row order lora_gemm's SiLU
    epilogue reads, so a tile holds each gate row beside its up row."""
    g, u = t.chunk(2, dim)
    return torch.stack([g, u], dim + 1).flatten(dim, dim + 1)


@dataclass(frozen=True)
class AttnShape:
    """How q, k, v sit in one row of the fused qkv projection: [q heads | k heads | v heads] x head_dim."""

    heads: int
    kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads or self.head_dim % 2:
            raise ValueError(f"heads {self.heads} must be a multiple of kv_heads {self.kv_heads}; "
                             f"head_dim {self.head_dim} must be even (rotary halves)")


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (HF layout) in fp32, rounded to x.dtype; x [T, heads, D], cos/sin [T, D/2]."""
    xf = x.to(_acc(x))
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(xf.dtype), sin[:, None, :].to(xf.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


@dataclass(frozen=True)
class PrefixKV:
    """One layer's cached qkv rows of the per-policy prompt prefixes, and which rows each sequence reads.

    Sequence b attends first to rows[start[b] : start[b] + length[b]] (positions 0 .. length-1), then to its
    own tokens (positions length[b] ...). length 0: no prefix. Only the k and v parts of the rows are read."""

    rows: torch.Tensor    # [P_total, (H + 2 Hkv) D]
    start: torch.Tensor   # [B] int32
    length: torch.Tensor  # [B] int32


@dataclass(frozen=True)
class RopeCols:
    """The rotary embedding of a projection's output, applied by lora_gemm as it writes it. Columns [0, cols)
    hold heads of head_dim columns, q heads [0, q_cols) first, then k heads; each head is normed (Qwen3's
    q_norm / k_norm, rounded to the output dtype) when norms are given, then rotated at its row's position
    (cos/sin tables [P, head_dim / 2] fp32; fp32 inside, rounded to the output dtype). Later columns (v) are
    left alone. `packed`, when given, holds the same tables as pack_rope packs them: what the Gluon GEMM's
    epilogue reads (lora_gemm_ws.rope_ok); without it the pass after the GEMM rotates, with the same bits."""

    positions: torch.Tensor  # [M] int64, each row's position in its sequence (a cached prefix included)
    cos: torch.Tensor
    sin: torch.Tensor
    head_dim: int
    cols: int
    q_cols: int = 0
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    eps: float = 1e-6
    packed: torch.Tensor | None = None  # [P, head_dim / 2] int32

    def __post_init__(self) -> None:
        D = self.head_dim
        if D % 2 or self.cols % D or self.q_cols % D or not 0 <= self.q_cols <= self.cols:
            raise ValueError(f"rope columns {self.q_cols} (q) of {self.cols} must be whole heads of {D} (even)")
        c, s = self.cos, self.sin
        if (c.shape != s.shape or c.dim() != 2 or c.shape[1] != D // 2 or c.dtype != torch.float32
                or s.dtype != torch.float32 or not (c.is_contiguous() and s.is_contiguous())):
            raise ValueError(f"cos/sin must be contiguous fp32 [positions, {D // 2}], got {tuple(c.shape)}")
        pk = self.packed
        if pk is not None and (pk.shape != c.shape or pk.dtype != torch.int32 or not pk.is_contiguous()):
            raise ValueError(f"packed rope tables must be contiguous int32 {tuple(c.shape)} (pack_rope)")
        if self.positions.dim() != 1 or self.positions.dtype != torch.int64:
            raise ValueError(f"positions must be int64 [rows], got {self.positions.dtype} "
                             f"{tuple(self.positions.shape)}")
        if (self.q_norm is None) != (self.k_norm is None):
            raise ValueError("q_norm and k_norm come together")
        if self.normed and (self.q_norm.shape != (D,) or self.k_norm.shape != (D,)):
            raise ValueError(f"q_norm and k_norm must be [{D}]")

    @property
    def normed(self) -> bool:
        return self.q_norm is not None

    def split(self, split: int, rows: torch.Tensor) -> tuple[RopeCols, RopeCols]:
        """For DenseLoraLinear.split_rows: columns [:split] at `rows`, and columns [split:] at every row."""
        head = replace(self, positions=self.positions[rows], cols=min(self.cols, split),
                       q_cols=min(self.q_cols, split))
        tail = replace(self, cols=max(self.cols - split, 0), q_cols=max(self.q_cols - split, 0))
        return head, tail


def rope_tables(ang: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos/sin [P, D/2] fp32 of the fp64 angles ang [P, D/2]; packed: rounded to fp16 first, and also packed
    (pack_rope) for the Gluon GEMM's epilogue (Decoder.rope_tables says which engines take that)."""
    cos, sin = ((t.half() if packed else t).float().contiguous() for t in (ang.cos(), ang.sin()))
    return cos, sin, pack_rope(cos, sin) if packed else None


def pack_rope(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos and sin [P, D/2] fp32 tables of fp16 values as one int32 word an entry, fp16 cos in the low half and
    fp16 sin in the high half: half the bytes and loads of the two fp32 tables, for the same values.
    Why: at the 700 W cap the qkv GEMM's epilogue paid W1 2.1% for the rope, and packed tables gave 0.8% of it
    back (run 141: 181.2k against 179.8k, every pass)."""
    c16, s16 = cos.to(torch.float16), sin.to(torch.float16)
    if not (torch.equal(c16.float(), cos) and torch.equal(s16.float(), sin)):
        raise ValueError("pack_rope packs fp16 values: round the cos/sin tables to fp16 first")
    return ((c16.view(torch.int16).int() & 0xFFFF) | (s16.view(torch.int16).int() << 16)).contiguous()


def rope_cols(y: torch.Tensor, rope: RopeCols) -> torch.Tensor:
    """Semantics of RopeCols, in place on y [M, N >= cols]; returns y."""
    T, D = y.shape[0], rope.head_dim
    if T == 0:
        return y
    c, s = rope.cos[rope.positions], rope.sin[rope.positions]
    for lo, hi, norm in ((0, rope.q_cols, rope.q_norm), (rope.q_cols, rope.cols, rope.k_norm)):
        if hi > lo:
            x = y[:, lo:hi].reshape(T, (hi - lo) // D, D)
            y[:, lo:hi] = rotate_half(rmsnorm(x, norm, rope.eps) if norm is not None else x, c, s).reshape(T, hi - lo)
    return y


def varlen_attention(qkv: torch.Tensor, cu_seqlens: torch.Tensor, shape: AttnShape, scale: float,
                     window: int | None = None, last_only: bool = False, prefix: PrefixKV | None = None,
                     row_amax: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Semantics: q, k, v = split(qkv) (q and k already normed and rotated: RopeCols); causal
    softmax(q k^T * scale) v within each packed sequence (GQA: kv head h // (H // Hkv)), fp32 inside, rounded
    to qkv.dtype. With `prefix`, a sequence's keys are its cached prefix rows followed by its own tokens.
    Returns [Tq, H * D]; with last_only, only each sequence's last token queries (Tq = sequences); an empty
    sequence's row is zero. `window` limits each query to its last `window` keys. row_amax: also return
    partial row maxima of |out| [P, Tq] (see prologue's x_amax).

    Every product is row-blocked (rows_matmul, row_blocks), so a query's result depends only on its own
    sequence: the same with or without the prefix cache, in any batch."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    dt = _acc(qkv)

    def split(rows: torch.Tensor):
        n = rows.shape[0]
        return (rows[:, :H * D].reshape(n, H, D), rows[:, H * D:(H + Hkv) * D].reshape(n, Hkv, D),
                rows[:, (H + Hkv) * D:].reshape(n, Hkv, D))

    bounds = cu_seqlens.tolist()
    out = torch.zeros(len(bounds) - 1 if last_only else qkv.shape[0], H * D, dtype=qkv.dtype, device=qkv.device)
    for i in range(len(bounds) - 1):  # per sequence: sequences never see each other
        s, e = bounds[i], bounds[i + 1]
        if s == e:
            continue
        q, k, v = split(qkv[s:e])
        P = int(prefix.length[i]) if prefix is not None else 0
        if P:
            p0 = int(prefix.start[i])
            _, pk, pv = split(prefix.rows[p0:p0 + P])
            k, v = torch.cat([pk, k]), torch.cat([pv, v])
        m = P + e - s
        kpos = torch.arange(m, device=qkv.device)
        if last_only:
            q = q[-1:]
        qpos = kpos[m - q.shape[0]:]
        mask = kpos[None, :] <= qpos[:, None]
        if window is not None:
            mask &= kpos[None, :] > qpos[:, None] - window
        heads = []
        for h in range(H):
            kv = h // (H // Hkv)
            scores = rows_matmul(q[:, h].to(dt), k[:, kv].to(dt)) * scale
            probs = row_blocks(lambda x: torch.softmax(x, dim=-1), scores.masked_fill(~mask, float("-inf")))
            heads.append(rows_matmul(probs, v[:, kv].to(dt).T))
        o = torch.stack(heads, dim=1).reshape(q.shape[0], H * D).to(qkv.dtype)
        if last_only:
            out[i] = o[0]
        else:
            out[s:e] = o
    return (out, amax_parts(out)) if row_amax else out
