"""Each Triton kernel against its torch twin and an fp64 reference.

On CPU the kernels run under TRITON_INTERPRET=1 (set in conftest) in fp32, plus FP8 operands where the
interpreter is right (fp8 tl.dot); bf16 and the FP8 quantizer are checked on the GPU (-m gpu)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_cases import (
    CPU,
    CPU_ATTN_SHAPES,
    GPU,
    GPU_ATTN_SHAPES,
    adapters_for,
    check,
    further_from,
    gemm_case,
    gen,
    lora_stack,
    packed,
    shrink_in_k_order,
    up64,
)

from policyscan.kernels import reference
from policyscan.kernels.reference import PrefixKV

triton = pytest.importorskip("triton")
from policyscan.kernels.attention import varlen_attention  # noqa: E402
from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402
from policyscan.kernels.prologue import gluon_prologue, prologue  # noqa: E402

# the last: a rank past 64 (BR = 128), as r = 32 on q, k and v stacks to 96 in the qkv GEMM
GEMM_SHAPES = [(37, 45, 70, 1, 3), (130, 96, 200, 16, 9), (1, 64, 33, 5, 1), (75, 72, 96, 64, 128),
               (29, 40, 48, 100, 6)]
# rank 64 with 128x256 tiles (M = 2000, N = 3072): where Triton's pipelining of the expand's adapter loop made the
# FP8 rows wrong (runs 67-71, kernels/lora_gemm.py); past 64, the Gluon kernel's expand in 64-rank pieces
# (M = 3000: rank 128 unmasked as at 64, rank 192 with 128 adapters) and Triton's at BR = 128 (M = 1500; from 1025
# rows the default takes the Gluon kernel, so the Triton kernel is reached there through the explicit feeds)
GPU_GEMM_SHAPES = [(300, 3072, 3072, 16, 8), (1000, 5120, 3072, 48, 128), (77, 8192, 3072, 7, 5),
                   (513, 3072, 8192, 1, 64), (2000, 3072, 1024, 64, 128), (4099, 3072, 3072, 16, 8),
                   (3000, 5120, 1024, 128, 16), (3000, 3072, 1024, 192, 128), (1500, 3072, 1024, 96, 16)]
# pointer-fed, TMA-fed, TMA-fed persistent (with fewer programs than tiles); TMA falls back to pointers
# where a row stride is not 16-byte aligned (K=33, 45 in fp32)
FEEDS = [{}, {"TMA": True}, {"TMA": True, "PERSISTENT": True}]


def variants(device):
    if device == "cpu":
        return [(torch.float32, False), (torch.float32, True)]
    return [(torch.bfloat16, False), (torch.bfloat16, True)]


EPILOGUES = [(False, False, False), (True, False, False), (False, True, False), (False, False, True),
             (False, True, True)]


def feeds(device, residual: bool, bias: bool, silu: bool) -> list[dict]:
    """The feeds to test an epilogue with. Every feed for the plain one. Both kernels call the same _epilogue
    with the same arguments, so in the interpreter each other epilogue takes one feed in turn (TMA, persistent,
    pointers, TMA), each kernel running a flagged epilogue too (every feed with every epilogue was 47 s of the
    CPU suite's work); on the GPU, where each feed is a compile per variant, the pointer feed with a residual or
    a bias, every feed without."""
    if not (residual or bias or silu):
        return FEEDS
    if device != "cpu":
        return [{}] if residual or bias else FEEDS
    return [FEEDS[(EPILOGUES.index((residual, bias, silu)) % 3)]]


@pytest.mark.slow  # in the interpreter: 5 shapes x 2 precisions, 3 feeds for the plain epilogue, ~2-6 s each
@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("residual,bias,silu", EPILOGUES)
def test_lora_gemm(device, residual, bias, silu):
    g = gen()
    for M, N, K, r, n_ad in (GEMM_SHAPES if device == "cpu" else GPU_GEMM_SHAPES):
        N += N % 2 if silu else 0  # gate and up halves
        for dtype, fp8 in variants(device):
            case, _ = gemm_case(M, N, K, r, n_ad, dtype, fp8, residual, bias, g, device)
            same = reference.lora_gemm(**case, out_dtype=dtype, silu_out=silu)
            ref64 = reference.lora_gemm(**up64(case), out_dtype=torch.float64, silu_out=silu)
            for feed in feeds(device, residual, bias, silu):
                out = torch.full((M, N // 2 if silu else N), float("nan"), dtype=dtype, device=device)
                lora_gemm(**case, out_dtype=dtype, silu_out=silu, out=out, config=feed)
                check(out, same, ref64, f"lora_gemm M={M} N={N} K={K} r={r} n={n_ad} {dtype} fp8={fp8} silu={silu} "
                                        f"{feed}")


@pytest.mark.parametrize("device", [CPU, GPU])
def test_lora_gemm_without_lora_and_all_rows_without_adapter(device):
    g = gen()
    dtype = variants(device)[0][0]
    case, _ = gemm_case(40, 48, 64, 4, 3, dtype, False, True, False, g, device)
    same = reference.lora_gemm(**{**case, "s": None, "B": None}, out_dtype=dtype)
    out = lora_gemm(**{**case, "s": None, "B": None}, out_dtype=dtype)
    check(out, same, reference.lora_gemm(**up64({**case, "s": None, "B": None}), out_dtype=torch.float64), "no lora")
    case["token_adapter"] = torch.full_like(case["token_adapter"], -1)
    assert torch.allclose(lora_gemm(**case, out_dtype=dtype).float(), out.float())


@pytest.mark.parametrize("device,feed", [pytest.param("cpu", "sweep", id="interp"),
                                         pytest.param("cuda", "sweep", id="gpu", marks=pytest.mark.gpu),
                                         pytest.param("cuda", "tma", id="gpu-tma", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", ["norm", "plain"])
def test_prologue(device, feed, kind):
    """feed "tma": given the writer's row maxima, the TMA-fed Gluon kernel (gluon_prologue.py) where it can run
    (ranks up to 64; past that the Triton kernel), h8 bitwise the Triton kernel's."""
    g = gen()
    shapes = [(37, 70, 1, 3), (64, 96, 16, 9), (1, 33, 5, 1), (50, 48, 64, 128), (20, 40, 100, 5)] \
        if device == "cpu" else [(300, 3072, 16, 8), (1000, 8192, 48, 128), (5, 3072, 1, 1), (700, 3072, 96, 16),
                                 (300, 2048, 200, 8), (4099, 3072, 64, 5), (1, 1024, 33, 200)]
    for M, K, r, n_ad in shapes:
        for dtype, quant in variants(device) if device == "cuda" else [(torch.float32, False)]:
            x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
            w = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype).to(device) if kind == "norm" else None
            ad = adapters_for(M, n_ad, g, device)
            A, _ = lora_stack(n_ad, r, 1, K, dtype, g, device)
            fold = quant and w is not None  # A carries the norm's weight, as layers.Fp8LoraLinear folds it
            args = (x, w, 1e-5, (A.float() * w.float()).to(dtype) if fold else A, ad, quant)
            nan = float("nan")
            out = (torch.full((M, K), nan, device=device).to(torch.float8_e4m3fn if quant else dtype),
                   torch.full((M,), nan, device=device) if quant else None,
                   torch.full((M, r), nan, device=device).to(dtype))  # s in A's dtype (reference.prologue)
            what = f"prologue {kind} {feed} M={M} K={K} r={r} {dtype} quant={quant}"
            if feed == "tma" and quant:
                u = x.float() * w.float() if w is not None else x.float()
                parts = u.abs().reshape(M, 8, K // 8).amax(-1).T.contiguous()  # the writer's 8 partial maxima
                assert gluon_prologue.usable(x, args[3], out[0]) == (r <= 64), what
                h, hs, s = prologue(*args, out=out, x_amax=parts, tma=True)
                assert torch.equal(h.view(torch.uint8), prologue(*args, x_amax=parts)[0].view(torch.uint8)), what
            else:
                h, hs, s = prologue(*args, out=out)
            rh, rhs, rs = reference.prologue(*args)
            e64 = reference.prologue(*up64(dict(enumerate((x, w, 1e-5, A, ad)))).values(), False)  # rmsnorm(x) @ A
            if quant:
                check(h.double() * hs.double()[:, None], rh.double() * rhs.double()[:, None], e64[0], what + " h")
            else:
                check(h, rh, e64[0], what + " h")
            if fold:  # the shrink reads x, times rstd
                k_order = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5) * shrink_in_k_order(x, args[3], ad)
            else:  # the shrink reads the 16-bit normed row (or x)
                k_order = shrink_in_k_order(reference.rmsnorm(x, w, 1e-5) if w is not None else x, A, ad)
            assert s.dtype == rs.dtype == A.dtype, what
            check(s, further_from(e64[2], rs, k_order.to(dtype)), e64[2], what + " s", factor=4.0)


def test_prologue_s_is_in_the_adapters_dtype():
    """s leaves the prologue in A's dtype, the expand's operand dtype (reference.prologue); an `out` whose s
    has another dtype or shape is refused, not written through a cast the GEMM would not expect."""
    g = gen()
    x = torch.randn(6, 32, generator=g)
    ad = torch.zeros(6, dtype=torch.int32)
    A, _ = lora_stack(2, 4, 1, 32, torch.float32, g, "cpu")
    for quant in (False, True):
        _, _, rs = reference.prologue(x.bfloat16(), None, 1e-5, A.bfloat16(), ad, quant)
        assert rs.dtype == torch.bfloat16
    h = torch.empty(6, 32)
    for bad in (torch.empty(6, 4, dtype=torch.bfloat16), torch.empty(6, 5)):
        with pytest.raises(ValueError, match="A's dtype"):
            prologue(x, None, 1e-5, A, ad, False, out=(h, None, bad))
    assert prologue(x, None, 1e-5, A, ad, False)[2].dtype == torch.float32


@pytest.mark.parametrize("device", [CPU, GPU])
def test_fp8_prologue_on_zero_and_tiny_rows(device):
    """Rows of zeros (scale 1) and of values near fp32's smallest normal, whose amax / 448 falls below 2^-126:
    the scale stops there (reference.quantize_rows), so the GPU's reciprocal of it stays finite."""
    g = gen()
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    M, K = 24, 96 if device == "cpu" else 3072
    x = torch.randn(M, K, generator=g)
    x = torch.cat([x[:8] * 0, x[8:16] * 1e-37, x[16:] * 1e-30]).to(dtype).to(device)
    ad = torch.zeros(M, dtype=torch.int32, device=device)
    h, hs, _ = prologue(x, None, 1e-5, None, ad, True)
    rh, rhs = reference.quantize_rows(x)
    assert torch.isfinite(hs).all() and (hs[:8] == 1).all() and (hs[8:] >= torch.finfo(torch.float32).tiny).all()
    assert torch.equal(hs[8:16], rhs[8:16]), "the floor of the scale"
    if device == "cuda":  # the interpreter's e4m3 rounding is not the GPU's (the module docstring)
        check(h.double() * hs.double()[:, None], rh.double() * rhs.double()[:, None], x.double(), "tiny rows")


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("norm", [False, True])
def test_prologue_single_adapter_sweep_is_bitwise_the_adapter_loop(device, norm):
    """The two sweeps of the prologue (ONE_AD: one adapter in the block, A's loads pipelined; or the loop over
    the block's adapters) write the same bits, in blocks of one adapter, several, and none; 16-bit and FP8."""
    g = gen()
    shapes = [(37, 70, 3, 4), (64, 96, 16, 9)] if device == "cpu" else [(300, 3072, 48, 8), (1000, 8192, 16, 64)]
    for M, K, r, n_ad in shapes:
        for quant in (False, True):
            dtype = torch.float32 if device == "cpu" else torch.bfloat16
            x = (torch.randn(M, K, generator=g) * 2).to(dtype).to(device)
            w = (1 + 0.3 * torch.randn(K, generator=g)).to(dtype).to(device) if norm else None
            ad = adapters_for(M, n_ad, g, device)
            A, _ = lora_stack(n_ad, r, 1, K, dtype, g, device)
            cfg = dict(BM=16, BK=32, num_warps=4) if device == "cpu" else dict(BM=64, BK=128, num_warps=4)
            one, loop = (prologue(x, w, 1e-5, A, ad, quant, config=dict(cfg, ONE_AD=o)) for o in (True, False))
            for a, b, what in zip(one, loop, ("h", "scale", "s")):
                if a is not None:
                    assert torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                       b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b), \
                        f"M={M} K={K} r={r} norm={norm} quant={quant}: {what}"


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("window", [None, 9])
@pytest.mark.parametrize("last_only", [False, True])
def test_varlen_attention(device, window, last_only):
    """Odd lengths, length 1, and an empty sequence (how CUDA-graph padding looks); GQA groups of 1 to 7."""
    for shape in CPU_ATTN_SHAPES if device == "cpu" else GPU_ATTN_SHAPES:
        _check_varlen_attention(device, window, last_only, shape)


def _check_varlen_attention(device, window, last_only, shape):
    g = gen()
    if device == "cpu":
        lengths, dtype = [1, 7, 33, 0, 64, 20, 3], torch.float32
    else:
        lengths, dtype = [1, 700, 257, 64, 0, 1500, 3, 2100, 130], torch.bfloat16  # 2100: the long tile
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    T = sum(lengths)
    cu = packed(lengths, device)
    qkv = torch.randn(T, (H + 2 * Hkv) * D, generator=g).to(dtype).to(device)
    args = (cu, shape, D ** -0.5, window, last_only)
    out = torch.full((len(lengths) if last_only else T, H * D), float("nan"), dtype=dtype, device=device)
    varlen_attention(qkv, *args, out=out)
    same = reference.varlen_attention(qkv, *args)
    ref64 = reference.varlen_attention(qkv.double(), *args)
    check(out, same, ref64, f"attention {shape} window={window} last_only={last_only} {dtype}")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("residual,bias,silu", [(False, False, False), (True, False, False), (False, True, True)])
def test_gemm_kernels_agree_bitwise(fp8, residual, bias, silu):
    """On Hopper, FP8 and bf16 batches of over 1024 rows go to the warp-specialized Gluon kernel and smaller ones to
    the Triton kernel (also the fallback for operands TMA cannot take): both must give the same bits, whichever
    tiles the Triton kernel takes, so that no batch size changes a row. Outputs poisoned with NaN first."""
    from policyscan.kernels import lora_gemm_ws
    from policyscan.kernels.tuning import gemm_tiles
    g = gen()
    for M, N, K, r, n_ad in GPU_GEMM_SHAPES:
        N += N % 2 if silu else 0
        case, _ = gemm_case(M, N, K, r, n_ad, torch.bfloat16, fp8, residual, bias, g, "cuda")
        ws_ = torch.full((M, N // 2 if silu else N), float("nan"), dtype=torch.bfloat16, device="cuda")
        assert lora_gemm_ws.usable(case["x"], case["W"], ws_, case["residual"], case["B"])
        lora_gemm_ws.lora_gemm_ws(*case.values(), ws_, silu)
        dtype = case["x"].dtype
        # the Triton kernel's tiles for a small and for a large batch of this dtype (bf16: 64 and 128 rows)
        for rows in (256, 4096):
            cfg = gemm_tiles(rows, N, dtype, False)
            tri = lora_gemm(**case, out_dtype=torch.bfloat16, silu_out=silu, config=cfg)
            assert torch.equal(ws_, tri), \
                f"M={M} N={N} K={K} r={r} n={n_ad} {dtype} residual={residual} bias={bias} silu={silu} {cfg}"


@pytest.mark.gpu
def test_silu_epilogue_at_extreme_gates():
    """The fast SiLU (kernels/fast_math.py) where its approximations meet their range ends: gates from -120 to 120 (bias
    on the gate rows), past -87 where 1 + exp(-g) leaves rcp's range. Both kernels the same bits, within the twin's
    error bound of fp64, and finite."""
    from policyscan.kernels import lora_gemm_ws
    g = gen()
    M, N, K = 2000, 3072, 1024
    case, _ = gemm_case(M, N, K, 16, 8, torch.bfloat16, True, False, True, g, "cuda")
    case["bias"][0::2] = torch.linspace(-120.0, 120.0, N // 2, device="cuda")
    ws_ = torch.full((M, N // 2), float("nan"), dtype=torch.bfloat16, device="cuda")
    lora_gemm_ws.lora_gemm_ws(*case.values(), ws_, True)
    tri = lora_gemm(**case, out_dtype=torch.bfloat16, silu_out=True, config={"TMA": True, "PERSISTENT": True})
    assert torch.equal(ws_, tri)
    same = reference.lora_gemm(**case, out_dtype=torch.bfloat16, silu_out=True)
    check(ws_, same, reference.lora_gemm(**up64(case), out_dtype=torch.float64, silu_out=True), "extreme gates")


@pytest.mark.gpu
@pytest.mark.parametrize("fp8,r", [(False, 16), (True, 16), (True, 48)])
def test_lora_gemm_rows_do_not_depend_on_batch(fp8, r):
    """Batch invariance: rows computed inside a large batch (other tile shape and, in FP8, the Gluon kernel)
    equal the same rows alone. At rank 48 (W1's qkv) the small calls' adapter loop is unpipelined (lora_gemm)."""
    g = gen()
    case, _ = gemm_case(8192, 3072, 3072, r, 8, torch.bfloat16, fp8, True, False, g, "cuda")
    full = lora_gemm(**case, out_dtype=torch.bfloat16)
    for lo, hi in [(0, 1), (100, 400), (1000, 2500), (5000, 5013)]:
        part = {k: (v[lo:hi] if k in ("x", "x_scale", "s", "token_adapter", "residual") and v is not None else v)
                for k, v in case.items()}
        assert torch.equal(lora_gemm(**part, out_dtype=torch.bfloat16), full[lo:hi]), (lo, hi)


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("last_only", [False, True])
def test_attention_rows_do_not_depend_on_the_batch(device, last_only, monkeypatch):
    """A sequence's tile is chosen by its own key count (tuning.attention_long_tile): sequences just under, at and
    over the threshold give the same bits in a batch of mixed lengths as alone. Outputs poisoned with NaN first."""
    from policyscan.kernels.tuning import attention_long_tile
    g = gen()
    shape = (CPU_ATTN_SHAPES if device == "cpu" else GPU_ATTN_SHAPES)[0]
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    if device == "cpu":  # a row-invariant matmul for the interpreter, as in the prefix test below
        matmul = np.matmul
        monkeypatch.setattr(np, "matmul", lambda a, b, **kw: np.stack([matmul(r, b, **kw) for r in a])
                            if a.ndim == 2 and b.ndim == 2 else matmul(a, b, **kw))
    long = attention_long_tile(H // Hkv, D, device == "cpu")
    assert long is not None, "no long tile at this shape: the test would check one tile only"
    k = long[0]
    lengths = [k - 1, 3, k, 0, k + 1, 2 * k + 5, 1, k // 2]
    rows = [torch.randn(n, (H + 2 * Hkv) * D, generator=g).to(dtype).to(device) for n in lengths]
    common = (shape, D ** -0.5, None, last_only)

    def attend(parts, lens):
        n_out = len(lens) if last_only else sum(lens)
        out = torch.full((n_out, H * D), float("nan"), dtype=dtype, device=device)
        return varlen_attention(torch.cat(parts), packed(lens, device), *common, out=out)

    batch = attend(rows, lengths)
    at = 0
    for i, (r, n) in enumerate(zip(rows, lengths)):
        alone = attend([r], [n])
        got = batch[i:i + 1] if last_only else batch[at:at + n]
        assert torch.equal(got, alone), f"length {n} (threshold {k})"
        at += n


@pytest.mark.parametrize("device", [CPU, GPU])
@pytest.mark.parametrize("last_only", [False, True])
@pytest.mark.parametrize("shape_i", [0, 2])
def test_attention_prefix_cache_is_bitwise_recompute(device, last_only, shape_i, monkeypatch):
    """Sequences attending to cached prefix rows give bitwise what the same sequences computed with their
    prefix inline give (kernel and twin), and the kernel stays within the twin's error of fp64."""
    g = gen()
    if device == "cpu":
        shape, dtype, prefixes, own = CPU_ATTN_SHAPES[shape_i], torch.float32, [0, 5, 19], [1, 7, 30, 12, 4]
    else:
        shape, dtype, prefixes, own = (GPU_ATTN_SHAPES[shape_i], torch.bfloat16, [0, 77, 256],
                                       [1, 300, 64, 1000, 2000, 5])  # 77 + 2000 keys: the long tile
    H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
    width = (H + 2 * Hkv) * D
    pre_rows = [torch.randn(n, width, generator=g).to(dtype) for n in prefixes]
    seq_pre = [i % len(prefixes) for i in range(len(own))]
    own_rows = [torch.randn(n, width, generator=g).to(dtype) for n in own]
    starts = torch.tensor([0] + prefixes).cumsum(0)[:-1]
    prefix = PrefixKV(torch.cat(pre_rows).to(device), starts[seq_pre].int().to(device),
                      torch.tensor([prefixes[j] for j in seq_pre]).int().to(device))
    qkv = torch.cat(own_rows).to(device)
    full = torch.cat([torch.cat([pre_rows[j], r]) for j, r in zip(seq_pre, own_rows)]).to(device)
    full_len = [prefixes[j] + n for j, n in zip(seq_pre, own)]
    common = (shape, D ** -0.5, None, last_only)
    own_idx = torch.cat([torch.arange(s + p, s + p + n) for s, p, n in
                         zip(torch.tensor([0] + full_len).cumsum(0).tolist(), [prefixes[j] for j in seq_pre], own)])
    if device == "cpu":
        # The interpreter's tl.dot is a numpy matmul, and OpenBLAS's sgemm moves a row's result in the last bit
        # with its place in the block (numpy 2.4 / OpenBLAS 0.3.31: 2040 of 6480 values here). The kernel's own
        # arithmetic is row-invariant, which is what this test is about: give the interpreter a matmul that is
        # too (one row at a time, so every row takes the same path).
        matmul = np.matmul
        monkeypatch.setattr(np, "matmul", lambda a, b, **kw: np.stack([matmul(r, b, **kw) for r in a])
                            if a.ndim == 2 and b.ndim == 2 else matmul(a, b, **kw))
    # the twin is row-invariant by construction on the CPU only (cuBLAS makes no such promise)
    for fn in (reference.varlen_attention, varlen_attention) if device == "cpu" else (varlen_attention,):
        cached = fn(qkv, packed(own, device), *common, prefix=prefix)
        inline = fn(full, packed(full_len, device), *common)
        assert torch.equal(cached, inline if last_only else inline[own_idx.to(device)]), fn.__module__
    same = reference.varlen_attention(qkv, packed(own, device), *common, prefix=prefix)
    exact = reference.varlen_attention(qkv.double(), packed(own, device), *common,
                                       prefix=PrefixKV(prefix.rows.double(), prefix.start, prefix.length))
    check(varlen_attention(qkv, packed(own, device), *common, prefix=prefix), same, exact, "prefix")
