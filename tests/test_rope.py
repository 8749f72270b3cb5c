"""Rotary embedding: the rope pass over k (and q) heads, and the attention's own rotation of q as it loads it
(QRope), each against its twin and fp64; and that rotating q in the attention is the same product as
rotating it in the pass before."""
from __future__ import annotations

import pytest
import torch

from kernel_cases import CPU, CPU_ATTN_SHAPES, GPU, GPU_ATTN_SHAPES, check, gen, packed
from policyscan.kernels import reference
from policyscan.kernels.reference import AttnShape, PrefixKV, QRope

triton = pytest.importorskip("triton")
from policyscan.kernels.attention import varlen_attention  # noqa: E402
from policyscan.kernels.rope import rope_qk  # noqa: E402


def rope_tables(positions: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    ang = torch.outer(torch.arange(positions, dtype=torch.float64), 1.0 / 500.0 ** (torch.arange(0, D, 2) / D))
    return ang.cos().float().to(device), ang.sin().float().to(device)


def head_norms(D: int, dtype, g, device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple((1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(device) for _ in range(2))


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotate_q", [True, False])
def test_rope_qk(device, qk_norm, rotate_q):
    g = gen()
    shape, dtype, T = (AttnShape(6, 2, 20), torch.float32, 37) if device == "cpu" else \
        (AttnShape(24, 8, 128), torch.bfloat16, 1001)
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    positions = torch.randint(0, 3000, (T,), generator=g).to(device)
    cos, sin = rope_tables(3000, D, device)
    qn, kn = head_norms(D, dtype, g, device) if qk_norm else (None, None)
    qn = qn if rotate_q else None
    out = rope_qk(qkv.clone(), positions, cos, sin, shape, qn, kn, 1e-6, rotate_q)
    same = reference.rope_qk(qkv.clone(), positions, cos, sin, shape, qn, kn, 1e-6, rotate_q)
    up = (None if t is None else t.double() for t in (qn, kn))
    ref64 = reference.rope_qk(qkv.double(), positions, cos, sin, shape, *up, 1e-6, rotate_q)
    assert torch.equal(out[:, (H + Hkv) * D:], qkv[:, (H + Hkv) * D:]), "v must be untouched"
    if not rotate_q:
        assert torch.equal(out[:, :H * D], qkv[:, :H * D]), "q must be untouched"
    check(out, same, ref64, f"rope_qk qk_norm={qk_norm} rotate_q={rotate_q} {dtype}")


def test_rope_qk_refuses_a_q_norm_it_would_not_apply():
    shape = AttnShape(2, 1, 8)
    qkv, cos = torch.zeros(3, 32), torch.zeros(4, 4)
    for fn in (rope_qk, reference.rope_qk):
        with pytest.raises(ValueError, match="QRope"):
            fn(qkv, torch.zeros(3, dtype=torch.int64), cos, cos, shape, torch.ones(8), torch.ones(8), rotate_q=False)


def _prefixed_case(device, shape, g):
    """Sequences (one empty, one of length 1) after cached prefixes of 0..n rows, packed with their lengths."""
    if device == "cpu":
        dtype, prefixes, own = torch.float32, [0, 5, 19], [1, 7, 30, 0, 12, 4]
    else:
        dtype, prefixes, own = torch.bfloat16, [0, 77, 256], [1, 300, 64, 0, 1000, 5]
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    width = (H + 2 * Hkv) * D
    seq_pre = [i % len(prefixes) for i in range(len(own))]
    starts = torch.tensor([0] + prefixes).cumsum(0)[:-1]
    rows = torch.randn(sum(prefixes), width, generator=g).to(dtype).to(device)
    prefix = PrefixKV(rows, starts[seq_pre].int().to(device),
                      torch.tensor([prefixes[j] for j in seq_pre]).int().to(device))
    qkv = torch.randn(sum(own), width, generator=g).to(dtype).to(device)
    positions = torch.cat([torch.arange(n) + prefixes[j] for j, n in zip(seq_pre, own)]).to(device)
    return qkv, packed(own, device), prefix, positions


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("last_only", [False, True])
def test_attention_rotates_q(device, qk_norm, last_only):
    """q normed and rotated at its position after the cached prefix, inside the attention; GQA groups 1 to 7."""
    for shape in CPU_ATTN_SHAPES if device == "cpu" else GPU_ATTN_SHAPES:
        g = gen()
        D = shape.head_dim
        qkv, cu, prefix, _ = _prefixed_case(device, shape, g)
        cos, sin = rope_tables(2048, D, device)
        qn = head_norms(D, qkv.dtype, g, device)[0] if qk_norm else None
        args = (cu, shape, D ** -0.5, None, last_only)
        rows = cu.numel() - 1 if last_only else qkv.shape[0]
        out = torch.full((rows, shape.heads * D), float("nan"), dtype=qkv.dtype, device=device)
        kernel_qkv, same_qkv, qkv64 = qkv.clone(), qkv.clone(), qkv.double()
        varlen_attention(kernel_qkv, *args, prefix=prefix, out=out, q_rope=QRope(cos, sin, qn, 1e-6))
        same = reference.varlen_attention(same_qkv, *args, prefix=prefix, q_rope=QRope(cos, sin, qn, 1e-6))
        ref64 = reference.varlen_attention(
            qkv64, *args, prefix=PrefixKV(prefix.rows.double(), prefix.start, prefix.length),
            q_rope=QRope(cos, sin, qn.double() if qn is not None else None, 1e-6))
        what = f"attention q_rope {shape} qk_norm={qk_norm} last_only={last_only} {qkv.dtype}"
        check(out, same, ref64, what)
        # the rows that query are left rotated in qkv (only the last ones with last_only), the rest untouched
        queried = (cu[1:] - 1)[cu[1:] > cu[:-1]].long() if last_only else torch.arange(qkv.shape[0], device=device)
        assert not torch.equal(same_qkv[queried], qkv[queried]), "the twin left q unrotated"
        check(kernel_qkv, same_qkv, qkv64, what + " qkv left rotated")


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rotating_q_in_the_attention_is_rotating_it_before(qk_norm):
    """The twin: rope_qk over q and k, then attention == rope_qk over k, then attention rotating q. Bitwise."""
    g = gen()
    shape = CPU_ATTN_SHAPES[0]
    D = shape.head_dim
    qkv, cu, prefix, positions = _prefixed_case("cpu", shape, g)
    cos, sin = rope_tables(64, D, "cpu")
    qn, kn = head_norms(D, qkv.dtype, g, "cpu") if qk_norm else (None, None)
    before = reference.rope_qk(qkv.clone(), positions, cos, sin, shape, qn, kn)
    k_only = reference.rope_qk(qkv.clone(), positions, cos, sin, shape, None, kn, rotate_q=False)
    for last_only in (False, True):
        args = (cu, shape, D ** -0.5, None, last_only)
        assert torch.equal(reference.varlen_attention(before, *args, prefix=prefix),
                           reference.varlen_attention(k_only.clone(), *args, prefix=prefix,
                                                      q_rope=QRope(cos, sin, qn)))
