"""What 1x128 activation groups (the FP8 option that cut the error most at FP8's cost, docs/performance.md)
cost in a GEMM's main loop, at W1's four projection shapes, on the GPU:

    python bench/fp8_groups.py [--rows 16384]

Two plain Triton FP8 GEMMs with the same tiles (128x256x128, 8 warps, 3 stages, TMA-free pointer loads): one
scales its fp32 accumulator once in the epilogue by the row's and the column's scale (per-token activations,
per-channel weights: what the engine does), the other promotes each K block's product into the accumulator
times that block's row scale (1x128 groups, as DeepGEMM does). Their ratio is the main loop's cost of groups;
the producers' group maxima and the engine's fused epilogue come on top. The shipped GEMM (no LoRA) is timed
beside them."""
from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl

from policyscan.kernels import triton_ops
from policyscan.kernels.reference import FP8

SHAPES = {"qkv": (5120, 3072), "o": (3072, 3072), "gate_up": (16384, 3072), "down": (3072, 8192)}  # (N, K)


@triton.jit
def _gemm(a, w, a_s, w_s, y, M, N, K, GROUPS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
          BK: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    acc = tl.zeros((BM, BN), tl.float32)
    for kb in range(0, tl.cdiv(K, BK)):
        x = tl.load(a + rm[:, None] * K + (kb * BK + rk)[None, :], mask=rm[:, None] < M, other=0.0)
        v = tl.load(w + rn[None, :] * K + (kb * BK + rk)[:, None], mask=rn[None, :] < N, other=0.0)
        if GROUPS:
            s = tl.load(a_s + rm * tl.cdiv(K, BK) + kb, mask=rm < M, other=0.0)
            acc += tl.dot(x, v) * s[:, None]
        else:
            acc = tl.dot(x, v, acc)
    if not GROUPS:
        acc *= tl.load(a_s + rm, mask=rm < M, other=0.0)[:, None]
    acc *= tl.load(w_s + rn, mask=rn < N, other=0.0)[None, :]
    tl.store(y + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16), mask=(rm[:, None] < M) & (rn[None, :] < N))


def gemm(a, w, a_s, w_s, groups: bool) -> torch.Tensor:
    M, K = a.shape
    N = w.shape[0]
    y = torch.empty(M, N, dtype=torch.bfloat16, device=a.device)
    _gemm[(triton.cdiv(M, 128), triton.cdiv(N, 256))](a, w, a_s, w_s, y, M, N, K, groups, 128, 256, 128,
                                                       num_warps=8, num_stages=3)
    return y


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=16384)
    args = ap.parse_args()
    torch.manual_seed(0)
    M = args.rows
    print("| projection | per-token TFLOP/s | 1x128 groups TFLOP/s | groups / per-token | shipped GEMM TFLOP/s |")
    print("|---|---|---|---|---|")
    for name, (N, K) in SHAPES.items():
        a = torch.randn(M, K, device="cuda").to(FP8)
        w = torch.randn(N, K, device="cuda").to(FP8)
        a_tok = torch.rand(M, device="cuda") + 0.5
        a_grp = torch.rand(M, K // 128, device="cuda") + 0.5
        w_s = torch.rand(N, device="cuda") + 0.5
        ta = torch.full((M,), -1, dtype=torch.int32, device="cuda")
        same = gemm(a, w, a_tok[:, None].expand(M, K // 128).contiguous(), w_s, True).float()
        ref = gemm(a, w, a_tok, w_s, False).float()
        assert (same - ref).abs().max() <= 1e-2 * ref.abs().max(), "the two GEMMs disagree"
        flop = 2 * M * N * K
        tok = triton.testing.do_bench(lambda: gemm(a, w, a_tok, w_s, False), warmup=50, rep=300)
        grp = triton.testing.do_bench(lambda: gemm(a, w, a_grp, w_s, True), warmup=50, rep=300)
        ship = triton.testing.do_bench(lambda: triton_ops.lora_gemm(a, a_tok, w, w_s, None, None, ta, None, None,
                                                                          torch.bfloat16),
                                       warmup=50, rep=300)
        print(f"| {name} ({M}x{N}x{K}) | {flop / tok / 1e9:.0f} | {flop / grp / 1e9:.0f} | {tok / grp:.3f} | "
              f"{flop / ship / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
