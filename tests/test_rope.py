"""Rotary embedding of a projection's q and k heads (RopeCols): the rope pass against its twin and fp64, the
split that the last layer's qkv takes, and on Hopper the Gluon GEMM's epilogue rotation, bitwise the pass."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kernel_cases import CPU, GPU, check, gemm_case, gen, up64

from policyscan.kernels import reference
from policyscan.kernels.reference import AttnShape, RopeCols

triton = pytest.importorskip("triton")
from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402
from policyscan.kernels.rope import rope_cols  # noqa: E402


def rope_tables(positions: int, D: int, dtype, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """cos, sin as Decoder.rope_tables makes them for an FP8 engine at 16 bits (fp16 values, packed; the GEMM
    tests' FP8 batches), fp32 otherwise."""
    ang = torch.outer(torch.arange(positions, dtype=torch.float64), 1.0 / 500.0 ** (torch.arange(0, D, 2) / D))
    return tuple(t.to(device) if t is not None else None for t in reference.rope_tables(ang, dtype.itemsize == 2))


def head_norms(D: int, dtype, g, device) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple((1 + 0.3 * torch.randn(D, generator=g)).to(dtype).to(device) for _ in range(2))


def qkv_rope(shape: AttnShape, T: int, qk_norm: bool, dtype, g, device, cols: str = "qk") -> RopeCols:
    """cols: "qk" the whole qkv projection's q and k heads, "k" a projection of k and v (q_cols 0), "q" of q."""
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    positions = torch.randint(0, 3000, (T,), generator=g).to(device)
    cos, sin, packed = rope_tables(3000, D, dtype, device)
    qn, kn = head_norms(D, dtype, g, device) if qk_norm else (None, None)
    n, q = {"qk": ((H + Hkv) * D, H * D), "k": (Hkv * D, 0), "q": (H * D, H * D)}[cols]
    return RopeCols(positions, cos, sin, D, n, q, qn, kn, 1e-6, packed)


def widen(rope: RopeCols) -> RopeCols:
    up = (None if t is None else t.double() for t in (rope.q_norm, rope.k_norm))
    return RopeCols(rope.positions, rope.cos, rope.sin, rope.head_dim, rope.cols, rope.q_cols, *up, rope.eps)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("cols", ["qk", "k", "q"])
def test_rope_cols(device, qk_norm, cols):
    g = gen()
    shape, dtype, T = (AttnShape(6, 2, 20), torch.float32, 37) if device == "cpu" else \
        (AttnShape(24, 8, 128), torch.bfloat16, 1001)
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    y = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    rope = qkv_rope(shape, T, qk_norm, dtype, g, device, cols)
    out = rope_cols(y.clone(), rope)
    same = reference.rope_cols(y.clone(), rope)
    ref64 = reference.rope_cols(y.double(), widen(rope))
    assert torch.equal(out[:, rope.cols:], y[:, rope.cols:]), "columns past the rope columns must be untouched"
    assert not torch.equal(out[:, :rope.cols], y[:, :rope.cols])
    check(out, same, ref64, f"rope_cols {cols} qk_norm={qk_norm} {dtype}")


def test_rope_cols_is_checked():
    pos, tab = torch.zeros(3, dtype=torch.int64), torch.zeros(4, 4)
    for bad, match in [(dict(cols=12), "whole heads"), (dict(q_cols=24), "whole heads"),
                       (dict(q_norm=torch.ones(8)), "come together"), (dict(positions=pos.int()), "int64"),
                       (dict(cos=torch.zeros(4, 3)), "cos/sin"), (dict(packed=tab), "packed"),
                       (dict(packed=torch.zeros(4, 3, dtype=torch.int32)), "packed")]:
        args = dict(positions=pos, cos=tab, sin=tab, head_dim=8, cols=16, q_cols=8) | bad
        with pytest.raises(ValueError, match=match):
            RopeCols(**args)
    with pytest.raises(ValueError, match="rows"):
        rope_cols(torch.zeros(5, 32), RopeCols(pos, tab, tab, 8, 16, 8))


def test_pack_rope_holds_the_tables():
    """Each word: fp16 cos in the low half, fp16 sin in the high half (gluon_rope.py unpacks them so); tables
    that are not fp16 values are refused, not rounded behind the caller's back."""
    cos, sin, packed = rope_tables(300, 64, torch.bfloat16, "cpu")
    assert packed.dtype == torch.int32 and packed.shape == cos.shape
    halves = packed.view(torch.float16).view(300, 32, 2)  # little-endian: the low half first
    assert torch.equal(halves[..., 0].float(), cos) and torch.equal(halves[..., 1].float(), sin)
    assert (sin < 0).any() and (cos < 0).any()  # sign bits in both halves
    exact, _, _ = rope_tables(300, 64, torch.float32, "cpu")
    with pytest.raises(ValueError, match="fp16"):
        reference.pack_rope(exact, sin)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_split_is_the_whole(qk_norm):
    """The last layer's qkv: q at a few rows, k and v at every row (RopeCols.split), each rotated as the whole."""
    g = gen()
    shape = AttnShape(6, 2, 20)
    H, D = shape.heads, shape.head_dim
    y = torch.randn(23, (H + 2 * shape.kv_heads) * D, generator=g)
    rope = qkv_rope(shape, 23, qk_norm, y.dtype, g, "cpu")
    rows = torch.tensor([0, 5, 22])
    head, tail = rope.split(H * D, rows)
    whole = reference.rope_cols(y.clone(), rope)
    parts = y.clone()
    parts[:, H * D:] = reference.rope_cols(y[:, H * D:].clone(), tail)
    parts[rows, :H * D] = reference.rope_cols(y[rows, :H * D].clone(), head)
    assert torch.equal(parts[:, H * D:], whole[:, H * D:]) and torch.equal(parts[rows], whole[rows])


@pytest.mark.parametrize("qk_norm", [False, True])
def test_lora_gemm_with_rope(qk_norm):
    """The Triton GEMM (interpreter) with rope: the GEMM, then the pass over its output columns (a view, as the
    last layer's k and v), against the twin and fp64; rope with a SiLU epilogue or row maxima is refused."""
    g = gen()
    shape = AttnShape(6, 2, 16)
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    M, N = 37, (H + 2 * Hkv) * D
    case, _ = gemm_case(M, N, 48, 5, 3, torch.float32, False, False, True, g, "cpu")
    rope = qkv_rope(shape, M, qk_norm, torch.float32, g, "cpu")
    wide = torch.full((M, N + 16), float("nan"))
    out = lora_gemm(**case, out_dtype=torch.float32, out=wide[:, 16:], rope=rope)
    same = reference.lora_gemm(**case, out_dtype=torch.float32, rope=rope)
    ref64 = reference.lora_gemm(**up64(case), out_dtype=torch.float64, rope=widen(rope))
    check(out, same, ref64, f"lora_gemm with rope qk_norm={qk_norm}")
    plain = reference.lora_gemm(**case, out_dtype=torch.float32)
    assert torch.equal(same[:, rope.cols:], plain[:, rope.cols:]) and not torch.equal(same, plain)
    for bad in (dict(silu_out=True), dict(row_amax=True)):
        for fn in (lora_gemm, reference.lora_gemm):
            with pytest.raises(ValueError, match="rope"):
                fn(**case, out_dtype=torch.float32, rope=rope, **bad)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [AttnShape(24, 8, 128), AttnShape(32, 8, 64), AttnShape(14, 2, 64),
                                   AttnShape(12, 3, 64)], ids=["W1", "W4", "group7", "tile_past_rope_cols"])
@pytest.mark.parametrize("cols", ["qk", "k"])
def test_gemm_epilogue_rope_is_the_pass(shape, cols):
    """FP8 batches of over 1024 rows rotate q and k in the Gluon GEMM's epilogue, smaller ones (and Qwen3's
    normed heads) in the pass after the GEMM: the rows must be bitwise the same, and within the twin's error."""
    from policyscan.kernels import lora_gemm_ws
    g = gen()
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    N = (H + 2 * Hkv) * D if cols == "qk" else 2 * Hkv * D
    for M in (1025, 3001):
        case, _ = gemm_case(M, N, 1040, 48, 8, torch.bfloat16, True, False, False, g, "cuda")  # K: TMA rows
        rope = qkv_rope(shape, M, False, torch.bfloat16, g, "cuda", cols)
        wide = torch.full((M, N + 64), float("nan"), dtype=torch.bfloat16, device="cuda")
        out = lora_gemm(**case, out_dtype=torch.bfloat16, out=wide[:, 64:], rope=rope)  # a view, as split_rows
        assert lora_gemm_ws.rope_ok(rope) and lora_gemm_ws.usable(case["x"], case["W"], out, None, case["B"])
        plain = lora_gemm(**case, out_dtype=torch.bfloat16, config={"TMA": True, "PERSISTENT": True})
        assert torch.equal(out, rope_cols(plain, rope)), f"M={M} {shape} {cols}"
        unpacked = replace(rope, packed=None)  # without packed tables the pass rotates: the same rows
        assert not lora_gemm_ws.rope_ok(unpacked)
        assert torch.equal(lora_gemm(**case, out_dtype=torch.bfloat16, rope=unpacked), out)
        same = reference.lora_gemm(**case, out_dtype=torch.bfloat16, rope=rope)
        ref64 = reference.lora_gemm(**up64(case), out_dtype=torch.float64, rope=rope)
        check(out, same, ref64, f"epilogue rope M={M} {shape} {cols}")


@pytest.mark.parametrize("fp8", [True, False])
def test_decoder_rope_tables_follow_the_engine(fp8):
    """Decoder.rope_tables: fp64 angles; with FP8 activations rounded to fp16 and packed for the qkv GEMM's
    epilogue, exact fp32 otherwise; grown on demand, the values never depend on the size."""
    from policyscan.engine.model.config import ModelConfig, RopeConfig, inv_freq
    from policyscan.engine.model.model import Decoder
    from policyscan.engine.model.precision import Precision
    cfg = ModelConfig("llama", 64, 96, 1, 4, 2, 16, 100, 1e-5, RopeConfig(10000.0), True)
    dec = Decoder(cfg, Precision(torch.bfloat16, fp8, fp8), torch.zeros(100, 64, dtype=torch.bfloat16), [],
                  torch.ones(64), reference, lambda ids: None)
    cos, sin, packed = dec.rope_tables(10)
    ang = torch.outer(torch.arange(cos.shape[0], dtype=torch.float64), inv_freq(cfg))
    rnd = torch.float16 if fp8 else torch.float32
    assert cos.dtype == sin.dtype == torch.float32 and cos.shape == (4096, 8)
    assert torch.equal(cos, ang.cos().to(rnd).float()) and torch.equal(sin, ang.sin().to(rnd).float())
    if fp8:
        assert torch.equal(packed, reference.pack_rope(cos, sin))
    else:
        assert packed is None
    bigger = dec.rope_tables(5000)
    assert bigger[0].shape[0] == 5000 and torch.equal(bigger[0][:4096], cos)
