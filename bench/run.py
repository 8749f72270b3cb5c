"""Benchmarks on the GPU, HF + PEFT baseline in the same run (docs/performance.md).

    python bench/run.py --workloads W1,W3,W4 --baseline W1,W4 --gemm --out $OUT/bench.json

Where a pass's time goes, kernel by kernel against the roofline: bench/roofline.py (it replaced --profile).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from power import PowerSampler, describe, layer_rate, sustained_gemm_rates  # noqa: E402
from workloads import WORKLOADS, hf_peft_model, left_padded, prompts, random_decoder, shape  # noqa: E402

from policyscan.engine.run.batch import pack, plan_batches  # noqa: E402
from policyscan.engine.run.graphs import GraphedForward  # noqa: E402
from policyscan.engine.settings import EngineSettings  # noqa: E402
from policyscan.kernels import triton_ops  # noqa: E402

DEVICE = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: a dry run of this script
FP8_TFLOPS = (1238.0, 1462.0)  # measured torch._scaled_mm rates on this H200 (docs/performance.md)


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def engine_pass(dec, prefixes=None, cache: bool = True, graphs: bool = True):
    """A scoring pass as the Engine runs one: run(seqs, ads, budget) -> f, token ids in. The prefix cache is
    made once (as the Engine does at load; a few ms) or, with cache=False, the prefixes are prepended; CUDA
    graphs serve batches of <= 4096 tokens unless graphs=False."""
    prefix = None
    if cache and prefixes and any(prefixes):
        with torch.inference_mode():
            prefix = dec.prefill_prefixes(prefixes)
    if graphs and DEVICE == "cuda":
        forward = GraphedForward(dec, prefix)
    else:
        def forward(b):
            return dec.forward(b.to(DEVICE), prefix)

    def run(seqs, ads, budget: int) -> np.ndarray:
        if prefixes and any(prefixes) and prefix is None:
            seqs = [prefixes[a] + s for s, a in zip(seqs, ads)]
        ads_np = np.array(ads)
        outs = []
        with torch.inference_mode():
            for plan in plan_batches(np.array([len(s) for s in seqs]), ads_np, budget):
                b = pack([seqs[i] for i in plan.items], ads_np[plan.items].tolist())
                outs.append((plan.items, forward(b)))
            f = np.empty(len(seqs), dtype=np.float32)
            for items, v in outs:
                f[items] = v.float().cpu().numpy()
        return f

    return run


def bench_engine(name: str, budget: int, fp8: bool = True, cache: bool = True, graphs: bool = True,
                 sampler: PowerSampler | None = None) -> dict:
    w = WORKLOADS[name]
    cfg = shape(w.model)
    dec = random_decoder(cfg, w.adapters, 16, triton_ops, device=DEVICE, fp8=fp8)
    seqs, ads, prefixes = prompts(w, cfg.vocab)
    tokens = sum(map(len, seqs)) + sum(len(prefixes[a]) for a in ads)  # all prompt tokens, cached or not
    run = engine_pass(dec, prefixes, cache, graphs)
    run(seqs[: 4 * w.adapters], ads[: 4 * w.adapters], budget)  # compile
    run(seqs, ads, budget)  # warm every batch size once
    sync()
    wall0, t0 = time.time(), time.perf_counter()
    run(seqs, ads, budget)
    sync()
    dt = time.perf_counter() - t0
    power = sampler.window(wall0, time.time()) if sampler is not None else {}
    params = cfg.layers * sum(o * i for o, i in (cfg.proj_shape(p) for p in
                              ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")))
    ceiling = tokens / (2 * params * tokens / (FP8_TFLOPS[1] * 1e12))
    del dec, run
    torch.cuda.empty_cache()
    label = name + ("" if cache or not w.prefix else " no-cache") + \
        (f" @{budget}" if budget != EngineSettings.batch_tokens else "") + ("" if graphs else " eager")
    return {"workload": label, "model": w.model, "tokens": tokens, "seconds": dt,
            "tok_s": tokens / dt, "fp8": fp8, "flops_per_token": 2 * params,
            "ceiling_tok_s": ceiling, "of_ceiling": tokens / dt / ceiling, "power": power}


def bench_hf(name: str, bs: int = 32, bf16_adapters: bool = True) -> dict:
    """HF + PEFT per-policy loop (set_adapter), length-sorted batches, left padding, logits_to_keep=1.
    PEFT keeps the adapters of a bf16 model in fp32 by default (autocast_adapter_dtype); cast to bf16 the
    loop ran 1.56x faster on W1 (35.9k vs 23.0k tok/s): that is the baseline."""
    w = WORKLOADS[name]
    cfg = shape(w.model)
    model = hf_peft_model(cfg, w.adapters)
    if bf16_adapters:
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.data = p.data.to(torch.bfloat16)
    lora_dtypes = {p.dtype for n, p in model.named_parameters() if "lora_" in n}
    model.eval()
    seqs, ads, prefixes = prompts(w, cfg.vocab)
    tokens = sum(map(len, seqs)) + sum(len(prefixes[a]) for a in ads)
    convs = [s for s, a in zip(seqs, ads) if a == 0]
    by_len = sorted(range(len(convs)), key=lambda i: len(convs[i]))

    def run(model, limit=None):
        with torch.inference_mode():
            for a in range(w.adapters if limit is None else 1):
                model.set_adapter(f"a{a}")
                for i in range(0, len(by_len) if limit is None else limit, bs):
                    ids, mask = left_padded([prefixes[a] + convs[j] for j in by_len[i:i + bs]])
                    out = model(input_ids=ids.cuda(), attention_mask=mask.cuda(), logits_to_keep=1).logits
                    out[:, -1, [11, 13]].float().cpu()

    run(model, limit=bs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    run(model)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    label = name + (f" bs{bs}" if bs != 32 else "") + ("" if bf16_adapters else " fp32-adapters (PEFT default)")
    print(f"baseline {label}: LoRA weights were {sorted(map(str, lora_dtypes))}, {tokens / dt:,.0f} tok/s")
    return {"baseline": label, "tokens": tokens, "seconds": dt, "tok_s": tokens / dt}


def bench_gemm() -> list[dict]:
    """Fused FP8 LoRA GEMM vs torch._scaled_mm + a separate expand-and-add kernel, and vs bare _scaled_mm."""
    from triton.testing import do_bench_cudagraph

    from policyscan.kernels.lora_gemm import lora_gemm
    from policyscan.kernels.reference import quantize_rows

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:  # clocks up before the first timing (idle SM clock is 345 MHz)
        a @ a
    torch.cuda.synchronize()
    rows = []
    for M, N, K in [(300, 3072, 3072), (300, 5120, 3072), (300, 16384, 3072), (300, 3072, 8192),
                    (16384, 5120, 3072), (16384, 3072, 8192)]:
        g = torch.Generator(device="cuda").manual_seed(0)
        x8, xs = quantize_rows(torch.randn(M, K, device="cuda", generator=g).bfloat16())
        w8, ws = quantize_rows(torch.randn(N, K, device="cuda", generator=g).bfloat16())
        r, n = 16, 8
        B = (torch.randn(n, N, r, device="cuda", generator=g) * 0.01).bfloat16()
        s = torch.randn(M, r, device="cuda", generator=g)
        ad = torch.sort(torch.randint(0, n, (M,), device="cuda", generator=g).int()).values
        res = torch.randn(M, N, device="cuda", generator=g).bfloat16()
        wt = w8.t()
        z8, zs = torch.zeros(M, 16, device="cuda").to(torch.float8_e4m3fn), torch.ones(M, device="cuda")
        zw, zws = torch.zeros(N, 16, device="cuda").to(torch.float8_e4m3fn), torch.ones(N, device="cuda")

        def fused():
            return lora_gemm(x8, xs, w8, ws, s, B, ad, None, res, torch.bfloat16)

        def scaled():
            return torch._scaled_mm(x8, wt, scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16)

        def separate():  # GEMM (+ residual) then a second kernel that re-reads y to add the expand
            y = torch._scaled_mm(x8, wt, scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16) + res
            return lora_gemm(z8, zs, zw, zws, s, B, ad, None, y, torch.bfloat16)

        # CUDA-graph replays: at a few hundred rows the kernels run ~15 us, less than a Python launch,
        # so plain event timing measured the launcher (0.10 ms fused vs 0.05 ms _scaled_mm)
        t = {k: do_bench_cudagraph(f, rep=100, return_mode="median") for k, f in
             (("fused", fused), ("scaled_mm", scaled), ("separate", separate))}
        tflops = 2 * M * N * K / (t["fused"] * 1e-3) / 1e12
        rows.append({"M": M, "N": N, "K": K, **{k + "_ms": v for k, v in t.items()}, "fused_tflops": tflops,
                     "speedup_vs_separate": t["separate"] / t["fused"],
                     "fused_over_scaled": t["fused"] / t["scaled_mm"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W3,W4")
    ap.add_argument("--baseline", default="W1,W4")
    ap.add_argument("--gemm", action="store_true")
    ap.add_argument("--budget", type=int, default=EngineSettings.batch_tokens)
    ap.add_argument("--bf16", action="store_true", help="also run W1 with bf16 weights")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-cache", action="store_true", help="also run W2 with prefixes recomputed")
    ap.add_argument("--baseline-variants", action="store_true",
                    help="also W1's baseline with PEFT's fp32 adapters, and at bs 64")
    ap.add_argument("--graphs", default=None, help="W4 at this small budget, with and without CUDA graphs")
    ap.add_argument("--sustained", action="store_true",
                    help="also the sustained (power-capped) FP8 GEMM rates and each workload's share of that ceiling")
    args = ap.parse_args()
    res: dict = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__}
    if args.gemm:
        res["gemm"] = bench_gemm()
    sampler = PowerSampler() if DEVICE == "cuda" else None
    res["engine"] = [bench_engine(w, args.budget, sampler=sampler) for w in filter(None, args.workloads.split(","))]
    if args.bf16:
        res["engine"].append(bench_engine("W1", args.budget, fp8=False, sampler=sampler))
    if args.no_cache:
        res["engine"].append(bench_engine("W2", args.budget, cache=False, sampler=sampler))
    if args.graphs:
        for graphs in (True, False):  # W1 at 2048: 73.9k with graphs, 74.2k without: GPU-bound
            res["engine"].append(bench_engine("W4", int(args.graphs), graphs=graphs, sampler=sampler))
    if args.sustained:
        res["sustained"] = sustained_gemm_rates(sampler)
    if sampler is not None:
        sampler.close()
    res["baseline"] = [bench_hf(w) for w in filter(None, args.baseline.split(","))]
    if args.baseline_variants:
        res["baseline"] += [bench_hf("W1", 32, False), bench_hf("W1", 64)]
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    for row in res.get("gemm", []):
        print(f"gemm M={row['M']:>5} N={row['N']:>5} K={row['K']:>5}: fused {row['fused_ms']:.3f} ms "
              f"({row['fused_tflops']:.0f} TF/s), scaled_mm {row['scaled_mm_ms']:.3f}, "
              f"separate {row['separate_ms']:.3f}"
              f" -> {row['speedup_vs_separate']:.2f}x vs separate, {row['fused_over_scaled']:.2f}x of bare")
    base = {b["baseline"]: b for b in res["baseline"]}
    w1 = next((e for e in res["engine"] if e["workload"] == "W1" and e["fp8"]), None)
    for e in res["engine"]:
        b = base.get(e["workload"])
        ratio = f", {e['tok_s'] / b['tok_s']:.2f}x HF ({b['tok_s']:,.0f} tok/s, {b['seconds']:.1f} s)" if b else ""
        rel = f", {e['tok_s'] / w1['tok_s']:.2f}x W1" if w1 and e is not w1 else ""
        held = ""
        if res.get("sustained"):  # the ceiling at the sustained rate of the best GEMM at this model's shapes
            m = "W1" if e["model"] == "3b" else "W4"
            rate = max(layer_rate(res["sustained"], m, k) for k in ("ours", "scaled_mm"))
            held = f", {e['tok_s'] / (rate * 1e12 / e['flops_per_token']):.0%} of the sustained one"
        print(f"{e['workload']}{'' if e['fp8'] else ' bf16'}: {e['tokens']:,} tokens in {e['seconds']:.2f} s = "
              f"{e['tok_s']:,.0f} tok/s ({e['of_ceiling']:.0%} of FP8 ceiling{held}){ratio}{rel}; "
              f"{describe(e['power'])}")
    w1_base = [b for b in res["baseline"] if b["baseline"].split()[0] == "W1"]
    if w1 and w1_base:
        best = max(w1_base, key=lambda b: b["tok_s"])
        print(f"W1 vs the best W1 baseline of this run ({best['baseline']}, {best['tok_s']:,.0f} tok/s): "
              f"{w1['tok_s'] / best['tok_s']:.2f}x")


if __name__ == "__main__":
    main()
