"""Torch twins of the Triton kernels: same signatures, same rounding points; the CPU engine runs on these.

Conventions shared with the kernels:
- `token_adapter` [T] int32: the adapter of each token's sequence, -1 for none.
- LoRA stacks: A [n, R, K], B [n, N, R] with the scale folded into B. `s = x @ A[a].T` is kept in fp32 and
  rounded to the compute dtype right before the expand (tensor cores take 16-bit operands).
- Accumulation in fp32 (fp64 when the inputs are fp64: the tests' exact reference); one rounding to the
  output dtype at the end.
"""
from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

from policyscan.kernels.cpu_rows import by_rows, map_items, product, rows_matmul
from policyscan.kernels.spans import RankSpans
from policyscan.kernels.types import AttnShape, PrefixKV, RopeCols

__all__ = ["AttnShape", "PrefixKV", "RopeCols"]  # re-exported: the engine imports them from here

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def _acc(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Semantics: (x / sqrt(mean(x^2) + eps)) * weight, in fp32, rounded to x.dtype.
    On whole tensors: every op here gives a row the bits it gets in a 16-row block alone (tests/test_cpu_threads)."""
    xf = x.to(_acc(x))
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)).to(x.dtype)


def head(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, head_rows: torch.Tensor,
         seq_adapter: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    """Semantics: f = (rmsnorm(h, w, eps).float() * head_rows[seq_adapter]).sum(-1), fp32; 0 for adapter -1.
    softcap: head_rows is [n, 2, H], each policy's W[Violation] and W[Compliant] rows, and
    f = cap * tanh(l_v / cap) - cap * tanh(l_c / cap) of the two logits l = hn . row."""
    ad = seq_adapter.long()
    rows = head_rows[ad.clamp(min=0)] * (ad >= 0).view(-1, *[1] * (head_rows.dim() - 1))
    hn = rmsnorm(h, norm_weight, eps).float()
    if softcap is None:
        return (hn * rows).sum(-1)
    capped = softcap * torch.tanh((hn[:, None, :] * rows).sum(-1) / softcap)
    return capped[:, 0] - capped[:, 1]


def quantize_rows(x: torch.Tensor, amax: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row e4m3 quantization: x8 = x / scale with scale = amax(|row|) / 448, at least 2^-126 (the smallest
    normal fp32, whose reciprocal the GPU prologue multiplies by), and 1 for an all-zero row; `amax` [M], when
    given, is that row maximum already known."""
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True) if amax is None else amax.float()[:, None]
    scale = torch.where(amax > 0, (amax / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny),
                        torch.ones_like(amax))
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale.squeeze(-1)


def _rows(token_adapter: torch.Tensor, a: int) -> slice | torch.Tensor:
    """Adapter a's rows: a slice where they are contiguous (a packed batch groups them), which indexes without a
    gather and scatter of every row (a tenth of a CPU pass at the 1b shape, docs/performance.md), else their
    indices."""
    rows = (token_adapter == a).nonzero().squeeze(1)
    first, last = (int(rows[0]), int(rows[-1])) if len(rows) else (0, -1)
    return slice(first, last + 1) if last - first + 1 == len(rows) else rows


def lora_shrink(x: torch.Tensor, A: torch.Tensor, token_adapter: torch.Tensor) -> torch.Tensor:
    """Semantics: s[t] = x[t] @ A[token_adapter[t]].T in fp32 (zeros where token_adapter is -1)."""
    s = torch.zeros(x.shape[0], A.shape[1], dtype=_acc(x), device=x.device)
    for a in torch.unique(token_adapter).tolist():  # a loop over adapters present, never over tokens
        if a < 0:
            continue
        rows = _rows(token_adapter, a)
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
    bits (faster end to end, docs/performance.md; f bitwise the same).
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
        rstd = torch.rsqrt(x.to(_acc(x)).pow(2).mean(-1) + eps)
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
              rope: RopeCols | None = None, gelu: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Semantics: y = (x @ W.T) * (x_scale[:, None] * w_scale[None, :]) + s.to(dtype) @ B[adapter].T
    (+ bias) (+ residual), accumulated in fp32, rounded once to out_dtype. W is [N, K].
    silu_out: W's rows alternate gate, up (interleave_halves); y = silu(y[:, 0::2]) * y[:, 1::2], [M, N/2];
    with gelu, gelu_tanh(y[:, 0::2]) * y[:, 1::2] instead (gemma2's gelu_pytorch_tanh).
    out: written in place (a view, e.g. some columns of a wider tensor) and returned.
    row_amax: also return partial row maxima of |y| [P, M], of |y * amax_weight| when given (prologue's x_amax).
    spans: where B can be nonzero (kernels.spans); it changes no result, so the twin takes every rank.
    rope: q and k heads of y rotated (RopeCols, rope_cols) after its rounding; a plain output only."""
    if rope is not None and (silu_out or row_amax):
        raise ValueError("rope applies to a plain projection's output (no SiLU epilogue, no row maxima)")
    if row_amax:
        y = lora_gemm(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, out_dtype, silu_out, out=out,
                      gelu=gelu)
        return y, amax_parts(y if amax_weight is None else y.float() * amax_weight.float())
    dt = torch.float64 if torch.float64 in (out_dtype, W.dtype) else torch.float32
    shape = (x.shape[0], W.shape[0] // 2 if silu_out else W.shape[0])
    if out is not None and (tuple(out.shape) != shape or out.dtype != out_dtype):
        raise ValueError(f"out must be {list(shape)} {out_dtype}, got {list(out.shape)} {out.dtype}")
    y = x.new_empty(shape, dtype=out_dtype) if out is None else out  # as the GPU launcher: out written in place

    def rows(r: slice) -> None:
        _lora_rows(x[r], None if x_scale is None else x_scale[r], W, w_scale, None if s is None else s[r],
                   B, token_adapter[r], bias, None if residual is None else residual[r], dt, silu_out, gelu, y[r])
        if rope is not None:
            rope_cols(y[r], replace(rope, positions=rope.positions[r]))
    by_rows(rows, x.shape[0])
    return y


def _lora_rows(x, x_scale, W, w_scale, s, B, token_adapter, bias, residual, dt, silu_out, gelu,
               out: torch.Tensor) -> None:
    """lora_gemm's arithmetic on some rows, start to finish, into out (those rows of the output). The
    accumulator is out itself where it can be (a plain fp32 or fp64 projection), with the same operations in
    place: the same bits."""
    shared = {t.untyped_storage().data_ptr() for t in (x, residual) if t is not None}
    direct = not silu_out and out.dtype == dt and out.is_contiguous() and out.untyped_storage().data_ptr() not in shared
    acc = rows_matmul(x.to(dt), W.to(dt), out if direct else None)
    if x_scale is not None:
        acc.mul_(x_scale.to(dt)[:, None] * w_scale.to(dt)[None, :])
    if s is not None:
        lo = s.to(B.dtype).to(dt)
        for a in torch.unique(token_adapter).tolist():
            if a < 0:
                continue
            rows = _rows(token_adapter, a)
            acc[rows] += rows_matmul(lo[rows], B[a].to(dt))
    if bias is not None:
        acc += bias.to(dt)
    if residual is not None:
        acc += residual.to(dt)
    if silu_out:
        act = partial(F.gelu, approximate="tanh") if gelu else F.silu
        out.copy_(act(acc[:, 0::2]) * acc[:, 1::2])
    elif not direct:
        out.copy_(acc)


def interleave_halves(t: torch.Tensor, dim: int = 0) -> torch.Tensor:
    """[g0 .. g(I-1), u0 .. u(I-1)] -> [g0, u0, g1, u1, ...] along dim: the row order lora_gemm's SiLU
    epilogue reads, so a tile holds each gate row beside its up row."""
    g, u = t.chunk(2, dim)
    return torch.stack([g, u], dim + 1).flatten(dim, dim + 1)


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding (HF layout) in fp32, rounded to x.dtype; x [T, heads, D], cos/sin [T, D/2]."""
    xf = x.to(_acc(x))
    x1, x2 = xf.chunk(2, dim=-1)
    c, s = cos[:, None, :].to(xf.dtype), sin[:, None, :].to(xf.dtype)
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1).to(x.dtype)


def rope_tables(ang: torch.Tensor, packed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos/sin [P, D/2] fp32 of the fp64 angles ang [P, D/2]; packed: rounded to fp16 first, and also packed
    (pack_rope) for the Gluon GEMM's epilogue (Decoder.rope_tables says which engines take that)."""
    cos, sin = ((t.half() if packed else t).float().contiguous() for t in (ang.cos(), ang.sin()))
    return cos, sin, pack_rope(cos, sin) if packed else None


def pack_rope(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """cos and sin [P, D/2] fp32 tables of fp16 values as one int32 word an entry, fp16 cos in the low half and
    fp16 sin in the high half: half the bytes and loads of the two fp32 tables, for the same values.
    Why: at the GPU's power cap the qkv GEMM's epilogue pays for the rope's table loads, and packed tables win back
    part of what the rope costs (docs/performance.md)."""
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
                     row_amax: bool = False, softcap: float | None = None
                     ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Semantics: q, k, v = split(qkv) (q and k already normed and rotated: RopeCols); causal
    softmax(q k^T * scale) v within each packed sequence (GQA: kv head h // (H // Hkv)), fp32 inside, rounded
    to qkv.dtype. With `prefix`, a sequence's keys are its cached prefix rows followed by its own tokens.
    Returns [Tq, H * D]; with last_only, only each sequence's last token queries (Tq = sequences); an empty
    sequence's row is zero. `window` limits each query to its last `window` keys. row_amax: also return
    partial row maxima of |out| [P, Tq] (see prologue's x_amax). softcap: scores = cap * tanh(scores / cap)
    after the scale, before the mask (gemma2).

    One sequence at a time (over the pool's threads), all its heads in two batched products whose rows are
    independent of how many queries share them (_product), so a query's result depends only on its own
    sequence: the same with or without the prefix cache, in any batch."""
    bounds = cu_seqlens.tolist()
    n_seq = len(bounds) - 1
    plen = prefix.length.tolist() if prefix is not None else [0] * n_seq
    pstart = prefix.start.tolist() if prefix is not None else [0] * n_seq
    out = torch.zeros(n_seq if last_only else qkv.shape[0], shape.heads * shape.head_dim, dtype=qkv.dtype,
                      device=qkv.device)
    q_cols = shape.heads * shape.head_dim

    def one(i: int) -> None:  # writes its sequence's rows of out: sequences never see each other
        s, e, P = bounds[i], bounds[i + 1], plen[i]
        if s == e:
            return
        kv = qkv[s:e, q_cols:]
        if P:
            kv = torch.cat([prefix.rows[pstart[i]:pstart[i] + P, q_cols:], kv])
        o = _attend(qkv[e - 1:e, :q_cols] if last_only else qkv[s:e, :q_cols], kv, shape, scale, window, softcap)
        if last_only:
            out[i] = o[0]
        else:
            out[s:e] = o

    map_items(one, range(n_seq))
    return (out, amax_parts(out)) if row_amax else out


def _attend(q: torch.Tensor, kv: torch.Tensor, shape: AttnShape, scale: float, window: int | None,
            softcap: float | None = None) -> torch.Tensor:
    """One sequence's attention: q [n, H*D], the last n of its m tokens; kv [m, 2*Hkv*D]; returns [n, H*D].
    A query row is (kv head, head in its group, token): the GQA group's heads share one product with their keys."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    G, n, m, dt = H // Hkv, q.shape[0], kv.shape[0], _acc(q)
    qh = q.to(dt).reshape(n, Hkv, G, D).permute(1, 2, 0, 3).reshape(Hkv, G * n, D)
    k = kv[:, :Hkv * D].to(dt).reshape(m, Hkv, D).transpose(0, 1)
    v = kv[:, Hkv * D:].to(dt).reshape(m, Hkv, D).permute(1, 2, 0)
    kpos = torch.arange(m, device=q.device)
    qpos = kpos[m - n:, None]
    hidden = kpos[None, :] > qpos
    if window is not None:
        hidden |= kpos[None, :] <= qpos - window
    scores = product(qh, k.contiguous()) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.view(Hkv, G, n, m).masked_fill_(hidden, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(Hkv, G * n, m)
    o = product(probs, v.contiguous())  # [Hkv, G*n, D]
    return o.view(Hkv, G, n, D).permute(2, 0, 1, 3).reshape(n, H * D).to(q.dtype)
