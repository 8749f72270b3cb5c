"""Where a workload's time goes, kernel by kernel, against the roofline (docs/performance.md, Ceilings).

    python bench/roofline.py --workloads W1,W4 [--bf16]

One eager pass (CUDA events around every kernel call; W1's and W4's batches are all above the 4096-token graph
limit but the last) after a warm one; per kind of call: GPU time, the work counted from the shapes (FLOPs of
the products, the fewest bytes the call must move), the rate reached, and the time at the roofline: FLOPs at
the dense tensor rate *at the SM clock the pass ran at* (the H200 holds its 700 W cap through a pass),
or bytes at the rate a device-to-device copy reaches on this device (measured first, copy_rate), whichever is
longer.
"""
from __future__ import annotations

import argparse
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from power import PowerSampler, describe  # noqa: E402
from run import DEVICE, engine_pass, sync  # noqa: E402
from workloads import WORKLOADS, prompts, random_decoder, shape  # noqa: E402

from policyscan.engine.settings import EngineSettings  # noqa: E402
from policyscan.kernels import triton_ops  # noqa: E402
from policyscan.kernels.launch import sm_count  # noqa: E402

FLOP_PER_CLK_SM = {1: 8192, 2: 4096}  # dense tensor-core FLOP per clock per SM: FP8, bf16 (H100/H200 SM)
COPY_BYTES = 1 << 30                  # a copy this large measures the memory roof (1 << 24 on a CPU dry run)


class HostEvent:
    """A CUDA event's two methods for the CPU dry run (BENCH_DEVICE=cpu TRITON_INTERPRET=1, workload T1), where
    every call finishes before it returns."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: "HostEvent") -> float:
        return (end.t - self.t) * 1e3


def event():
    return torch.cuda.Event(enable_timing=True) if DEVICE == "cuda" else HostEvent()


class Timed:
    """The kernel set with CUDA events around each call, filed under `tag` (a projection) or the call's name;
    the log keeps the call's work (counted at once: holding the activations would not fit), not its tensors."""

    def __init__(self, log: list, cfg, tag: str | None = None):
        self.log, self.cfg, self.tag = log, cfg, tag

    def __getattr__(self, name: str):
        fn = getattr(triton_ops, name)
        kind = f"{self.tag} {name}" if self.tag else name

        def call(*args, **kw):
            t0, t1 = event(), event()
            t0.record()
            out = fn(*args, **kw)
            t1.record()
            self.log.append((kind, t0, t1, work(kind, args, kw, self.cfg)))
            return out
        return call


def work(kind: str, args: tuple, kw: dict, cfg):
    """(FLOPs, fewest bytes moved, operand bytes of the products) of one call; for the attention a function
    that counts them later (from the sequence lengths, on the device until then: no sync inside the pass)."""
    if kind.endswith("lora_gemm"):
        x, W, s, res = args[0], args[2], args[4], args[8]
        (M, K), N = x.shape, W.shape[0]
        R = s.shape[1] if s is not None else 0
        n_out = N // 2 if (args[10] if len(args) > 10 else kw.get("silu_out", False)) else N
        flops = 2 * M * N * K + 2 * M * N * R
        moved = M * K * x.element_size() + N * K * W.element_size() + M * n_out * 2 \
            + (M * N * 2 if res is not None else 0)
        return flops, moved, x.element_size()
    if kind.endswith("prologue"):
        x, A, quant = args[0], args[3], args[5]
        M, K = x.shape
        R = A.shape[1] if A is not None else 0
        return 2 * M * K * R, M * K * (x.element_size() + (1 if quant else x.element_size())) + M * R * 4, 2
    if kind == "varlen_attention":
        qkv, cu, last_only = args[0], args[1], kw.get("last_only", False)
        qkv_bytes, T, H, D = qkv.numel() * qkv.element_size(), qkv.shape[0], cfg.heads, cfg.head_dim

        def later():
            L = np.diff(cu.cpu().numpy().astype(np.int64))
            pairs = L.sum() if last_only else (L * (L + 1) // 2).sum()
            return 4 * H * D * float(pairs), qkv_bytes + (len(L) if last_only else T) * H * D * 2, 2
        return later
    x = args[0]  # the final norm
    return 0.0, 2 * x.numel() * x.element_size(), 2


def copy_rate() -> float:
    """Bytes read and written a second by a device-to-device copy here, the best of 5: the memory roof that the
    calls' byte counts are held against."""
    n = COPY_BYTES if DEVICE == "cuda" else 1 << 24
    src = torch.ones(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return 2 * n / best


def profile(name: str, budget: int, sampler: PowerSampler | None, copy_bps: float, fp8: bool = True) -> None:
    w = WORKLOADS[name]
    cfg = shape(w.model)
    dec = random_decoder(cfg, w.adapters, 16, triton_ops, device=DEVICE, fp8=fp8)
    seqs, ads, prefixes = prompts(w, cfg.vocab)
    run = engine_pass(dec, prefixes, graphs=False)
    run(seqs, ads, budget)  # warm: every kernel variant loaded
    sync()
    wall0, t0 = time.time(), time.perf_counter()
    run(seqs, ads, budget)
    sync()
    plain = time.perf_counter() - t0
    power = sampler.window(wall0, time.time()) if sampler else {}
    log: list = []
    dec.ops = Timed(log, cfg)
    for layer in dec.layers:
        for tag in ("qkv", "o", "gate_up", "down"):
            getattr(layer, tag).ops = Timed(log, cfg, tag)
    t0 = time.perf_counter()
    run(seqs, ads, budget)
    sync()
    timed = time.perf_counter() - t0
    mhz = power.get("sm_mhz", 1980.0)
    sms = sm_count(torch.device(DEVICE))
    agg: dict = defaultdict(lambda: np.zeros(4))  # seconds, flops, bytes, roofline seconds
    for kind, e0, e1, info in log:
        sec = e0.elapsed_time(e1) / 1e3
        flops, moved, operand = info() if callable(info) else info
        peak = FLOP_PER_CLK_SM[operand] * sms * mhz * 1e6
        agg[kind] += (sec, flops, moved, max(flops / peak, moved / copy_bps))
    tokens = sum(map(len, seqs)) + sum(len(prefixes[a]) for a in ads)
    total = sum(v[0] for v in agg.values())
    print(f"\n{name} {'FP8' if fp8 else 'bf16'}: {tokens:,} tokens; pass {plain:.3f} s untimed "
          f"({tokens / plain:,.0f} tok/s), {timed:.3f} s with "
          f"events; kernels {total:.3f} s; {describe(power)}; roofline at {mhz:.0f} MHz: FP8 "
          f"{FLOP_PER_CLK_SM[1] * sms * mhz / 1e6:.0f} TF/s, bf16 {FLOP_PER_CLK_SM[2] * sms * mhz / 1e6:.0f}, "
          f"copy {copy_bps / 1e12:.2f} TB/s (measured)")
    print(f"{'kernel':<22}{'calls':>6}{'seconds':>9}{'share':>7}{'TF/s':>7}{'TB/s':>6}{'roofline s':>11}{'of roof':>8}")
    calls = defaultdict(int)
    for kind, *_ in log:
        calls[kind] += 1
    roof = 0.0
    for kind, (sec, flops, moved, rsec) in sorted(agg.items(), key=lambda kv: -kv[1][0]):
        roof += rsec
        print(f"{kind:<22}{calls[kind]:>6}{sec:>9.3f}{sec / total:>7.1%}{flops / sec / 1e12:>7.0f}"
              f"{moved / sec / 1e12:>6.2f}{rsec:>11.3f}{rsec / sec:>8.0%}")
    print(f"{'all':<22}{len(log):>6}{total:>9.3f}{'':>7}{'':>7}{'':>6}{roof:>11.3f}{roof / total:>8.0%}")
    del dec, run
    if DEVICE == "cuda":
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W4")
    ap.add_argument("--budget", type=int, default=EngineSettings.batch_tokens)
    ap.add_argument("--bf16", action="store_true", help="the bf16 weights' pass instead of FP8's")
    args = ap.parse_args()
    sampler = PowerSampler() if DEVICE == "cuda" else None
    copy_bps = copy_rate()
    for name in args.workloads.split(","):
        profile(name, args.budget, sampler, copy_bps, fp8=not args.bf16)
    if sampler:
        sampler.close()


if __name__ == "__main__":
    main()
