"""Tile-shape sweep for the three kernels at W1's shapes (16384-token batches), CUDA-graph timed.

    python bench/sweep.py
Prints, per kernel and shape, each config's time and the best; the findings that matter go to docs/performance.md."""
from __future__ import annotations

import itertools
import sys
from pathlib import Path

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import lengths  # noqa: E402

from policyscan.kernels import reference  # noqa: E402
from policyscan.kernels.attention import varlen_attention  # noqa: E402
from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402
from policyscan.kernels.prologue import prologue  # noqa: E402
from policyscan.kernels.reference import AttnShape, quantize_rows  # noqa: E402

T = 16384


def timed(fn) -> float:
    try:
        return do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as e:  # a config that does not compile (shared memory, registers) is skipped
        print(f"    skipped: {type(e).__name__}: {str(e)[:80]}")
        return float("inf")


def sweep_prologue() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    ad = torch.sort(torch.randint(0, 8, (T,), device="cuda", generator=g).int()).values
    # each sweeps once, given its producer's row maxima (P partials, as in the model; w = 1: |x * w| = |x|)
    for name, K, norm, R, P in [("qkv", 3072, True, 48, 24), ("o", 3072, False, 16, 8), ("gate_up", 3072, True, 32, 24),
                                ("down", 8192, False, 16, 128), ("W4 qkv", 2048, True, 48, 16),
                                ("W4 o", 2048, False, 16, 8)]:
        x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        w = torch.ones(K, device="cuda", dtype=torch.bfloat16) if norm else None
        A = (torch.randn(8, R, K, device="cuda", generator=g) * 0.02).bfloat16()
        parts = x.float().abs().reshape(T, P, K // P).amax(-1).T.contiguous() if P else None
        base = timed(lambda: prologue(x, w, 1e-5, A, ad, True, x_amax=parts))
        best = None
        for bm, bk, nw in itertools.product([16, 32, 64], [128, 256, 512], [4, 8]):
            t = timed(lambda: prologue(x, w, 1e-5, A, ad, True, config=dict(BM=bm, BK=bk, num_warps=nw),
                                       x_amax=parts))
            if best is None or t < best[0]:
                best = (t, bm, bk, nw)
        nbytes = x.numel() * 2 + T * K  # read x once, write e4m3
        print(f"prologue {name}: default {base * 1e3:.0f} us; best {best[0] * 1e3:.0f} us at BM={best[1]} BK={best[2]} "
              f"warps={best[3]} ({nbytes / best[0] / 1e9:.2f} TB/s of one pass)")


def sweep_prologue_norm() -> None:
    """The norm prologues (qkv, gate_up), the slow ones per byte (1.2-1.5 TB/s against o's 2.9 before): larger
    row blocks read each adapter's A once for more rows (qkv: 48 ranks x 3072 of A per block, as many bytes a
    row as x itself at 64 rows), with the software pipeline's depth."""
    g = torch.Generator(device="cuda").manual_seed(0)
    ad = torch.sort(torch.randint(0, 8, (T,), device="cuda", generator=g).int()).values
    for name, K, R, P in [("qkv", 3072, 48, 24), ("gate_up", 3072, 32, 24), ("W4 qkv", 2048, 48, 16)]:
        x = torch.randn(T, K, device="cuda", generator=g).bfloat16()
        w = (1 + 0.1 * torch.randn(K, device="cuda", generator=g)).bfloat16()
        A = (torch.randn(8, R, K, device="cuda", generator=g) * 0.02).bfloat16()
        parts = (x.float() * w.float()).abs().reshape(T, P, K // P).amax(-1).T.contiguous()
        ref = prologue(x, w, 1e-5, A, ad, True, x_amax=parts)
        base = timed(lambda: prologue(x, w, 1e-5, A, ad, True, x_amax=parts))
        rows = []
        for bm, bk, nw, ns in itertools.product([64, 128], [64, 128], [4, 8], [1, 2, 3]):
            cfg = dict(BM=bm, BK=bk, num_warps=nw, num_stages=ns)
            out = prologue(x, w, 1e-5, A, ad, True, config=cfg, x_amax=parts)
            same = all(torch.equal(a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
                                   b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b)
                       for a, b in zip(out[:2], ref[:2]))
            err = (out[2] - ref[2]).abs().max().item()
            rows.append((timed(lambda: prologue(x, w, 1e-5, A, ad, True, config=cfg, x_amax=parts)), cfg, same, err))
        rows.sort(key=lambda r: r[0])
        nbytes = x.numel() * 2 + T * K
        print(f"prologue {name}: default {base * 1e3:.0f} us ({nbytes / base / 1e9:.2f} TB/s); best: " + "; ".join(
            f"{t * 1e3:.0f} us {c} h,scale bitwise {same} s |diff| {e:.1e}" for t, c, same, e in rows[:4]))


W1_SHAPES = [(5120, 3072), (3072, 3072), (16384, 3072), (3072, 8192)]  # qkv, o, gate_up, down: (N, K)
W4_SHAPES = [(3072, 2048), (2048, 2048), (16384, 2048), (2048, 8192)]
FEEDS = [{}, {"TMA": True}, {"TMA": True, "PERSISTENT": True}]


def _gemm_configs(M: int, tiles: list[tuple[int, int, int, int, int]], residual: bool, feeds: list[dict] = FEEDS,
                  shapes: list[tuple[int, int]] = W1_SHAPES) -> None:
    """Every (tile, feed) at M rows on the four shapes (qkv, o, gate_up, down), against the default and
    torch._scaled_mm, each checked bitwise against the default first. As in the engine, gate_up runs with its
    SiLU-and-mul epilogue and, with `residual`, o and down add their residual."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for (N, K), kind in zip(shapes, ("qkv", "o", "gate_up", "down")):
        (x8, xs, w8, ws, s, B, ad, _, res, _), so = _gemm_case(M, N, K, kind, g, rank=48, residual=residual,
                                                            first_adapter=0)
        fl = 2 * M * N * K
        bare = timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                              out_dtype=torch.bfloat16))
        base = timed(lambda: lora_gemm(x8, xs, w8, ws, s, B, ad, None, res, torch.bfloat16, silu_out=so))
        ref = lora_gemm(x8, xs, w8, ws, s, B, ad, None, res, torch.bfloat16, silu_out=so)
        best = None
        for (bm, bn, nw, ns, gm), feed in itertools.product(tiles, feeds):
            cfg = dict(BM=bm, BN=bn, num_warps=nw, num_stages=ns, GROUP_M=gm, **feed)
            run = lambda: lora_gemm(x8, xs, w8, ws, s, B, ad, None, res, torch.bfloat16,  # noqa: E731
                                    silu_out=so, config=cfg)
            try:
                same = torch.equal(run(), ref)
            except Exception as e:  # a config that does not compile (shared memory, registers, a pass) is skipped
                print(f"    gemm M={M} N={N} K={K} {cfg}: skipped: {type(e).__name__}: {str(e)[:200]}")
                continue
            if not same:
                print(f"    gemm M={M} N={N} K={K} {cfg}: WRONG (not bitwise the default's result)")
                continue
            t = timed(run)
            print(f"    gemm M={M} N={N} K={K} {cfg}: {fl / t / 1e9:.0f} TF/s")
            if best is None or t < best[0]:
                best = (t, cfg)
        best_s = f"best {best[0] * 1e3:.0f} us ({fl / best[0] / 1e9:.0f} TF/s) {best[1]}" if best else "no config ran"
        print(f"gemm M={M} N={N} K={K}: default {base * 1e3:.0f} us ({fl / base / 1e9:.0f} TF/s); {best_s}; "
              f"_scaled_mm {bare * 1e3:.0f} us ({fl / bare / 1e9:.0f} TF/s)")


def sweep_gemm() -> None:
    """Full batches (16k rows; o and down with their residual)."""
    _gemm_configs(T, [(128, 256, 8, 3, 8), (128, 256, 8, 4, 8), (128, 128, 8, 4, 8), (128, 128, 4, 4, 8),
                      (256, 128, 8, 3, 8), (128, 256, 8, 3, 16)], residual=True)


def sweep_gemm_w4() -> None:
    """Full batches at W4's shapes (Llama-3.2-1B: K = 2048, N = 2048 for o and down), not swept before;
    128x256 tiles at N = 2048 make 7.8 waves on 132 SMs."""
    persistent = {"TMA": True, "PERSISTENT": True}
    _gemm_configs(T, [(128, 256, 8, 3, 8), (128, 128, 8, 4, 8), (128, 128, 4, 4, 8), (256, 128, 8, 3, 8)],
                  residual=True, feeds=[persistent, {"TMA": True}], shapes=W4_SHAPES)


def sweep_gemm_small() -> None:
    """Small batches (CUDA-graph buckets, last layers) at M = 512 and 2048."""
    for M in (512, 2048):
        _gemm_configs(M, [(64, 128, 4, 4, 8), (128, 128, 8, 3, 8), (128, 256, 8, 3, 8)], residual=False)


def _gemm_case(M: int, N: int, K: int, kind: str, g: torch.Generator, rank: int = 16, residual: bool = True,
               first_adapter: int = -1, device: str = "cuda"):
    """lora_gemm's arguments for one layer kind (plain, qkv, o, gate_up, down) at M rows, FP8, and silu_out:
    rank-`rank` LoRA on 8 adapters, rows sorted by adapter from `first_adapter` (-1: some rows without one),
    o and down with their residual unless `residual` is off."""
    ad = torch.sort(torch.randint(first_adapter, 8, (M,), device=device, generator=g).int()).values
    x8, xs = quantize_rows(torch.randn(M, K, device=device, generator=g).bfloat16())
    w8, ws = quantize_rows(torch.randn(N, K, device=device, generator=g).bfloat16())
    lora = kind != "plain"
    B = (torch.randn(8, N, rank, device=device, generator=g) * 0.05).bfloat16() if lora else None
    s = torch.randn(M, rank, device=device, generator=g) if lora else None
    res = torch.randn(M, N, device=device, generator=g).bfloat16() if residual and kind in ("o", "down") else None
    return (x8, xs, w8, ws, s, B, ad, None, res, torch.bfloat16), kind == "gate_up"


TRITON_BIG = {"TMA": True, "PERSISTENT": True}  # the Triton kernel's config for M > 2048 (a config forces Triton)


def sweep_gemm_ws() -> None:
    """The warp-specialized ping-pong Gluon GEMM (kernels/lora_gemm_ws.py) against the Triton kernel's
    default config and torch._scaled_mm: error against the fp64 twin and bitwise agreement on odd shapes, then
    time at W1's and W4's shapes by the grouped order's group size (6 stages never fit in shared memory)."""
    from policyscan.kernels.lora_gemm_ws import lora_gemm_ws
    g = torch.Generator(device="cuda").manual_seed(0)
    for M, N, K, kind in [(1000, 1000, 1008, "qkv"), (333, 2056, 512, "o"), (4097, 784, 2048, "gate_up"),
                          (129, 3072, 3072, "down"), (700, 640, 256, "plain")]:
        args, so = _gemm_case(M, N, K, kind, g)
        # the twin in fp64, the tests' reference (e4m3 values are exact there; s is not rounded to bf16)
        y64 = reference.lora_gemm(*(a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                                    for a in args[:9]), torch.float64, silu_out=so)
        tri = lora_gemm(*args, silu_out=so, config=TRITON_BIG)
        ws_ = lora_gemm_ws(*args[:9], torch.full_like(tri, float("nan")), silu_out=so)
        e_t, e_w = ((o.double() - y64).abs().max().item() for o in (tri, ws_))
        print(f"gemm_ws check M={M} N={N} K={K} {kind}: max |err| triton {e_t:.3e}, ws {e_w:.3e}, "
              f"bitwise equal {torch.equal(tri, ws_)}")
    for shapes, name in ((W1_SHAPES, "W1"), (W4_SHAPES, "W4")):
        for (N, K), kind in zip(shapes, ("qkv", "o", "gate_up", "down")):
            M = T
            args, so = _gemm_case(M, N, K, kind, g)
            x8, xs, w8, ws = args[:4]
            fl = 2 * M * N * K
            out = torch.empty(M, N // 2 if so else N, device="cuda", dtype=torch.bfloat16)
            t = {"_scaled_mm": timed(lambda: torch._scaled_mm(x8, w8.t(), scale_a=xs[:, None], scale_b=ws[None, :],
                                                              out_dtype=torch.bfloat16)),
                 "triton": timed(lambda: lora_gemm(*args, silu_out=so, out=out, config=TRITON_BIG))}
            ref = lora_gemm_ws(*args[:9], out.clone(), silu_out=so)
            # the grouped tile order's group size, each twice (64x256 tiles, one m64n256 MMA a k step, lost at
            # every shape: 0.85-0.92x of 128x128; 5 stages lost)
            for gm in (8, 16, 32) * 2:
                key = f"ws g{gm}"
                run = lambda: lora_gemm_ws(*args[:9], out, silu_out=so, group_m=gm)  # noqa: E731
                try:
                    same = torch.equal(run(), ref)
                except Exception as e:  # shared memory, registers
                    print(f"    {key}: skipped: {type(e).__name__}: {str(e)[:120]}")
                    continue
                key += "" if same else " NOT BITWISE"
                t[key] = min(t.get(key, float("inf")), timed(run))  # each twice, interleaved: the cap's drift
            print(f"gemm_ws {name} {kind} M={M} N={N} K={K}: " +
                  ", ".join(f"{k} {v * 1e3:.0f} us ({fl / v / 1e9:.0f} TF/s)" for k, v in t.items()))


def _attn_batch(width: int = 40 * 128):
    """W1's first 16k-token batch: lengths, cu_seqlens, qkv rows [T, width], and the causal attention FLOPs per
    (head x head_dim)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = lengths(256)
    lens = lens[: int(np.searchsorted(np.cumsum(lens), T))]
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    qkv = torch.randn(int(cu[-1]), width, device="cuda", generator=g).bfloat16()
    fl = 4 * sum(int(n) * (int(n) + 1) / 2 for n in lens)
    return lens, cu.cuda(), qkv, fl


def sweep_attention(baseline=None) -> None:
    """Tile configs of the GQA-packed kernel at W1's and W4's heads (q and k rotated by the qkv GEMM before);
    `baseline`, another varlen_attention (a previous kernel, copied in by the caller), on the same batch."""
    for name, shape in (("W1", AttnShape(24, 8, 128)), ("W4", AttnShape(32, 8, 64))):
        H, Hkv, D = shape.heads, shape.kv_heads, shape.head_dim
        lens, cu, qkv, fl = _attn_batch((H + 2 * Hkv) * D)
        fl *= H * D
        base = timed(lambda: varlen_attention(qkv, cu, shape, D ** -0.5))
        if baseline is not None:
            old = timed(lambda: baseline(qkv, cu, shape, D ** -0.5))
            same = torch.equal(baseline(qkv, cu, shape, D ** -0.5), varlen_attention(qkv, cu, shape, D ** -0.5))
            print(f"attention {name}: previous kernel {old * 1e3:.0f} us ({fl / old / 1e9:.0f} TF/s); "
                  f"bitwise the same rows: {same}")
        G = H // Hkv
        rows = []
        # rows = BQ queries x G heads (no dead heads); 128 rows with two warpgroups; maxnreg 168 or
        # 128: three or four programs an SM (64x64 and one-warpgroup 128-row tiles lost)
        for (rows_, nw), bn, ns, mr in itertools.product([(64, 4), (128, 8)], [32], [2, 3], [None, 168, 128]):
            cfg = dict(BQ=rows_ // G, BN=bn, num_warps=nw, num_stages=ns, maxnreg=mr)
            t = timed(lambda: varlen_attention(qkv, cu, shape, D ** -0.5, config=cfg))
            rows.append((t, cfg))
        rows.sort(key=lambda r: r[0])
        print(f"attention {name} {int(cu[-1])} tokens, {len(lens)} seqs: default {base * 1e3:.0f} us "
              f"({fl / base / 1e9:.0f} TF/s); best: " + "; ".join(f"{t * 1e3:.0f} us {c}" for t, c in rows[:4]))


def sweep_attention_lib() -> None:
    """Ours against PyTorch's FlashAttention-2 varlen forward on the same batch: time, agreement, and whether
    a sequence's rows stay bitwise the same when it is scored with half the batch (batch invariance).
    A library kernel is allowed where it is as fast and batch-invariant; the engine would still need
    the cached prefix rows gathered in front of each sequence, which ours reads in place."""
    lens, cu, qkv, fl = _attn_batch()
    fl *= 24 * 128
    shape, T_ = AttnShape(24, 8, 128), qkv.shape[0]
    q, k, v = (qkv[:, a * 128:b * 128].unflatten(1, (b - a, 128)) for a, b in ((0, 24), (24, 32), (32, 40)))
    top = int(max(lens))

    def fa(q, k, v, cu):
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, top, top, 0.0, True, False,
                                                       scale=128 ** -0.5)[0]

    t_ours = timed(lambda: varlen_attention(qkv, cu, shape, 128 ** -0.5))
    t_fa = timed(lambda: fa(q, k, v, cu))
    ours, lib = varlen_attention(qkv, cu, shape, 128 ** -0.5), fa(q, k, v, cu).reshape(T_, -1)
    diff = (lib.float() - ours.float()).abs().max().item()
    half = len(lens) // 2  # the second half of the sequences alone, rows re-based to 0
    r0 = int(cu[half])
    cu2 = (cu[half:] - r0).int()
    invariant = torch.equal(fa(q[r0:], k[r0:], v[r0:], cu2).reshape(T_ - r0, -1), lib[r0:])
    ours_invariant = torch.equal(varlen_attention(qkv[r0:].contiguous(), cu2, shape, 128 ** -0.5), ours[r0:])
    print(f"attention lib: ours {t_ours * 1e3:.0f} us ({fl / t_ours / 1e9:.0f} TF/s), FA2 varlen {t_fa * 1e3:.0f} us "
          f"({fl / t_fa / 1e9:.0f} TF/s); max |diff| {diff:.2e}; "
          f"batch-invariant: FA2 {invariant}, ours {ours_invariant}")


if __name__ == "__main__":
    only = sys.argv[1:] or ["prologue", "gemm", "attention"]
    for name in only:
        globals()[f"sweep_{name}"]()
