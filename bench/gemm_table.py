"""The bf16 path against its ceilings, in one call: every bf16 GEMM of W1 and W5 (qkv, o, gate_up, down, fused as the
engine runs them) against torch.matmul (cuBLAS) at the same M, N and K, and the attention at W1's and W5's lengths
against the kernel behind torch SDPA's flash backend (FlashAttention-2's varlen forward), CUDA-graph timed.

    python bench/gemm_table.py [--rows 2048,16384,65536] [--workloads W1,W5] [--sweep]
    python bench/gemm_table.py --attention-only --workloads W5 --dense 1024,4096   # attention against the libraries

Per GEMM: cuBLAS's time for the bare product, the fused kernel lora_gemm picks (its LoRA expand, SiLU-and-mul or
residual included, so cuBLAS does less work), the Triton kernel alone, and whether the two kernels gave the same
bits (they must: lora_gemm picks between them by M). --sweep also times attention tiles (tuning.attention_tiles) and
says whether a tile with the shipped key block gives the shipped tile's bits;
--dense adds equal-length batches, where cuDNN's fused attention (SDPA's cuDNN backend) runs as well."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import WORKLOADS, shape, workload_lengths  # noqa: E402

from policyscan.kernels.attention import varlen_attention  # noqa: E402
from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402
from policyscan.kernels.reference import AttnShape  # noqa: E402
from policyscan.kernels.tuning import attention_long_tile, attention_tiles, gemm_tiles  # noqa: E402

RANK = 16
# projection, its fused projections (ranks stack), and its epilogue as the engine runs it
KINDS = [("qkv", ("q_proj", "k_proj", "v_proj"), ""), ("o", ("o_proj",), "residual"),
         ("gate_up", ("gate_proj", "up_proj"), "silu"), ("down", ("down_proj",), "residual")]


def timed(fn) -> float:
    """Median milliseconds of CUDA-graph replays."""
    return do_bench_cudagraph(fn, rep=60, return_mode="median")


def warm_clocks() -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    for _ in range(200):  # about a second of matmuls: the SM clock up from idle before the first timing
        a @ a
    torch.cuda.synchronize()


def gemm_rows(name: str, rows: list[int]) -> list[dict]:
    w = WORKLOADS[name]
    cfg = shape(w.model)
    g = torch.Generator(device="cuda").manual_seed(0)
    out = []
    for kind, projs, epilogue in KINDS:
        N = sum(cfg.proj_shape(p)[0] for p in projs)
        K = cfg.proj_shape(projs[0])[1]
        R = RANK * len(projs)
        W = (torch.randn(N, K, device="cuda", generator=g) * K ** -0.5).bfloat16()
        B = (torch.randn(w.adapters, N, R, device="cuda", generator=g) * 0.01).bfloat16()
        for M in rows:
            x = torch.randn(M, K, device="cuda", generator=g).bfloat16()
            s = torch.randn(M, R, device="cuda", generator=g)
            ad = torch.sort(torch.randint(0, w.adapters, (M,), device="cuda", generator=g).int()).values
            res = torch.randn(M, N, device="cuda", generator=g).bfloat16() if epilogue == "residual" else None
            silu = epilogue == "silu"
            y = torch.empty(M, N // 2 if silu else N, device="cuda", dtype=torch.bfloat16)
            y_tri = torch.empty_like(y)
            tri_cfg = gemm_tiles(M, N, torch.bfloat16, False)
            fused = lambda: lora_gemm(x, None, W, None, s, B, ad, None, res, torch.bfloat16,  # noqa: E731
                                      silu_out=silu, out=y)
            triton_ = lambda: lora_gemm(x, None, W, None, s, B, ad, None, res, torch.bfloat16,  # noqa: E731
                                        silu_out=silu, out=y_tri, config=tri_cfg)
            fused()
            triton_()
            same = torch.equal(y, y_tri)
            t_blas = timed(lambda: torch.matmul(x, W.t()))
            t_fused, t_tri = timed(fused), timed(triton_)
            fl = 2 * M * N * K
            out.append(dict(workload=name, kind=kind, M=M, N=N, K=K, R=R, cublas_ms=t_blas, fused_ms=t_fused,
                            triton_ms=t_tri, cublas_tf=fl / t_blas / 1e9, fused_tf=fl / t_fused / 1e9,
                            triton_tf=fl / t_tri / 1e9, of_cublas=t_blas / t_fused, bitwise=same))
    return out


def attention_batch(name: str, tokens: int, length: int | None = None):
    """The workload's first `tokens` prompt tokens as the engine packs them (each conversation once per policy), or
    with `length` that many tokens in sequences of that length: lengths, cu_seqlens, random qkv rows, the
    attention's shape and its causal FLOPs."""
    w = WORKLOADS[name]
    cfg = shape(w.model)
    if length is None:
        lens = np.repeat(workload_lengths(w), w.adapters)
        lens = lens[: max(1, int(np.searchsorted(np.cumsum(lens), tokens)))]
    else:
        lens = np.full(max(1, tokens // length), length)
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lens), 0)
    att = AttnShape(cfg.heads, cfg.kv_heads, cfg.head_dim)
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv = torch.randn(int(cu[-1]), (att.heads + 2 * att.kv_heads) * att.head_dim, device="cuda",
                      generator=g).bfloat16()
    fl = 4 * att.heads * att.head_dim * sum(int(n) * (int(n) + 1) / 2 for n in lens)
    return lens, cu.cuda(), qkv, att, fl


def attention_rows(name: str, tokens: int, sweep: bool, length: int | None = None) -> list[dict]:
    """Ours against FlashAttention-2's varlen forward on attention_batch's batch; on equal-length batches
    (`length`) also cuDNN's fused attention (SDPA's cuDNN backend, dense [B, H, S, D], key/value heads expanded),
    the other Hopper kernel torch ships: its ragged layout failed under CUDA-graph capture."""
    lens, cu, qkv, att, fl = attention_batch(name, tokens, length)
    H, Hkv, D = att.heads, att.kv_heads, att.head_dim
    scale = D ** -0.5
    q, k, v = (qkv[:, a * D:b * D].unflatten(1, (b - a, D)) for a, b in ((0, H), (H, H + Hkv), (H + Hkv, H + 2 * Hkv)))
    top = int(max(lens))

    def flash():
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, top, top, 0.0, True, False, scale=scale)[0]

    t_fa = timed(flash)
    t_ours = timed(lambda: varlen_attention(qkv, cu, att, scale))
    diff = (flash().reshape(qkv.shape[0], -1).float() - varlen_attention(qkv, cu, att, scale).float()).abs().max()
    base = dict(workload=name, tokens=int(cu[-1]), seqs=len(lens), longest=top)
    rows = [dict(base, config="flash (SDPA's kernel)", ms=t_fa, tf=fl / t_fa / 1e9),
            dict(base, config="policyscan (default)", ms=t_ours, tf=fl / t_ours / 1e9, max_diff=float(diff))]
    if length is not None:
        qd, kd, vd = (t.unflatten(0, (len(lens), length)).transpose(1, 2) for t in
                      (q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1)))
        t_cudnn = timed(lambda: torch.ops.aten._scaled_dot_product_cudnn_attention(
            qd, kd, vd, None, False, 0.0, True, False, scale=scale)[0])
        rows.append(dict(base, config="cuDNN dense", ms=t_cudnn, tf=fl / t_cudnn / 1e9))
    if sweep:
        G = H // Hkv
        shipped = varlen_attention(qkv, cu, att, scale)
        long = attention_long_tile(G, D, False)
        if long is None or top < long[0]:  # the key block of the one tile every sequence takes, if one
            batch_bn = attention_tiles(G, D, False)["BN"]
        else:
            batch_bn = long[1]["BN"] if min(lens) >= long[0] else None
        # rows, warps, key block, stages, register cap (bench/attention_ptx.py gives each tile's registers and
        # shared-memory traffic without a GPU)
        for r, nw, bn, ns, mr in [(64, 4, 32, 2, 128), (64, 4, 64, 2, None), (64, 4, 64, 3, 168), (128, 8, 32, 2, None),
                                  (128, 8, 64, 2, None), (128, 8, 64, 3, None), (128, 8, 128, 2, None),
                                  (64, 4, 128, 2, None)]:
            c = dict(BQ=max(1, r // G), BN=bn, num_warps=nw, num_stages=ns, maxnreg=mr)
            out = torch.full_like(shipped, float("nan"))  # poisoned: a row the config does not write shows
            try:
                t = timed(lambda: varlen_attention(qkv, cu, att, scale, config=c, out=out))
            except Exception as e:  # registers, shared memory: the config does not compile
                print(f"    attention {name} {c}: skipped: {type(e).__name__}: {str(e)[:100]}")
                continue
            # a key block sets the softmax's reduction order: only a batch whose sequences all take one shipped tile
            # of this key block can give the shipped bits
            same = torch.equal(out, shipped) if bn == batch_bn else None
            rows.append(dict(base, config=str(c), ms=t, tf=fl / t / 1e9, same=same))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="2048,16384,65536", help="GEMM batch rows M")
    ap.add_argument("--workloads", default="W1,W5")
    ap.add_argument("--attention-tokens", type=int, default=65536, help="tokens of the attention's batch")
    ap.add_argument("--sweep", action="store_true", help="also time attention tile configs")
    ap.add_argument("--attention-only", action="store_true", help="skip the GEMMs")
    ap.add_argument("--dense", default="", help="comma-separated lengths: also equal-length batches of each")
    args = ap.parse_args()
    warm_clocks()
    names = args.workloads.split(",")
    if not args.attention_only:
        print(f"{'GEMM':<14}{'M':>7}{'N':>7}{'K':>7}{'cuBLAS TF/s':>13}{'fused TF/s':>12}{'of cuBLAS':>11}"
              f"{'Triton TF/s':>13}{'same bits':>11}")
    for name in [] if args.attention_only else names:
        for r in gemm_rows(name, [int(m) for m in args.rows.split(",")]):
            print(f"{r['workload'] + ' ' + r['kind']:<14}{r['M']:>7}{r['N']:>7}{r['K']:>7}{r['cublas_tf']:>13.0f}"
                  f"{r['fused_tf']:>12.0f}{r['of_cublas']:>11.0%}{r['triton_tf']:>13.0f}{str(r['bitwise']):>11}",
                  flush=True)
    print(f"\n{'attention':<10}{'tokens':>8}{'seqs':>6}{'longest':>8}{'TF/s':>7}  config")
    for name in names:
        rows = attention_rows(name, args.attention_tokens, args.sweep)
        for n in filter(None, args.dense.split(",")):
            rows += attention_rows(name, args.attention_tokens, args.sweep, int(n))
        for r in rows:
            extra = f" (max |diff| to flash {r['max_diff']:.1e})" if "max_diff" in r else ""
            extra += "" if r.get("same") is None else f" (the shipped tile's bits: {r['same']})"
            print(f"{r['workload']:<10}{r['tokens']:>8}{r['seqs']:>6}{r['longest']:>8}{r['tf']:>7.0f}  "
                  f"{r['config']}{extra}", flush=True)


if __name__ == "__main__":
    main()
