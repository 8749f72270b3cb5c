"""Power, clocks and sustained FP8 GEMM rates: is a run bound by the GPU's power cap?

    python bench/power.py            # sustained (CUDA-graph loops, 2 s each) GEMM rates at W1's and W4's shapes

Why (docs/performance.md): the H200's FP8 GEMMs run into its 700 W cap within a second and clock
down to ~1400 MHz, so the burst rates of short timings (the 1238-1462 TF/s of burst timings) overstate
what a whole W1 pass can sustain, and a kernel that only gets faster without spending less energy hands its
gain to the GEMMs' clock. Every benchmark reports its mean power, SM clock and power-capped share.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep import W1_SHAPES, W4_SHAPES, _gemm_case  # noqa: E402

from policyscan.kernels.lora_gemm import lora_gemm  # noqa: E402

FIELDS = "timestamp,clocks.sm,power.draw.instant,clocks_event_reasons.active"
SW_POWER_CAP = 0x4  # nvidia-smi clocks_event_reasons bit: clocks lowered to hold the power limit


class PowerSampler:
    """nvidia-smi every 50 ms into a file (a pipe nobody reads fills after ~40 s and stalls the sampler);
    window(t0, t1) summarizes the samples taken between two time.time() stamps."""

    def __init__(self) -> None:
        self.ok = shutil.which("nvidia-smi") is not None and subprocess.run(
            ["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits"],
            capture_output=True).returncode == 0
        if self.ok:
            self.file = tempfile.NamedTemporaryFile("w+", suffix=".csv")
            self.proc = subprocess.Popen(["nvidia-smi", f"--query-gpu={FIELDS}", "--format=csv,noheader,nounits",
                                          "-lms", "50"], stdout=self.file, text=True)

    def window(self, t0: float, t1: float) -> dict:
        if not self.ok:
            return {}
        rows = []
        for line in Path(self.file.name).read_text().strip().splitlines():
            p = [v.strip() for v in line.split(",")]
            try:
                day, frac = p[0].split(".")
                ts = time.mktime(time.strptime(day, "%Y/%m/%d %H:%M:%S")) + float("0." + frac)
                rows.append((ts, float(p[1]), float(p[2]), int(p[3], 16)))
            except (ValueError, IndexError):
                continue
        sel = np.array([r for r in rows if t0 + 0.1 <= r[0] <= t1])
        if not len(sel):
            return {}
        return {"power_w": float(sel[:, 2].mean()), "sm_mhz": float(np.median(sel[:, 1])),
                "power_capped": float(np.mean((sel[:, 3].astype(np.int64) & SW_POWER_CAP) != 0)), "samples": len(sel)}

    def close(self) -> None:
        if self.ok:
            self.proc.terminate()
            self.proc.wait()
            self.file.close()


def describe(p: dict) -> str:
    return (f"{p['power_w']:.0f} W mean, SM {p['sm_mhz']:.0f} MHz, power-capped {p['power_capped']:.0%}"
            if p else "no power samples")


def sustained(fn, seconds: float = 2.0) -> float:
    """Seconds per call of fn over `seconds` of back-to-back CUDA-graph replays (10 calls a graph)."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(10):
            fn()
    t0, n = time.time(), 0
    while time.time() - t0 < seconds:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
        n += 50
    return (time.time() - t0) / n


def sustained_gemm_rates(sampler: PowerSampler | None = None, M: int = 16384) -> list[dict]:
    """Our fused GEMM (with its LoRA expand, residual or SiLU epilogue) and bare torch._scaled_mm at each
    projection shape of W1 and W4, each held for 2 s."""
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for model, shapes in (("W1", W1_SHAPES), ("W4", W4_SHAPES)):
        for (N, K), kind in zip(shapes, ("qkv", "o", "gate_up", "down")):
            args, silu = _gemm_case(M, N, K, kind, g)
            x8, xs, W8, ws = args[:4]
            y = torch.empty(M, N // 2 if silu else N, device="cuda", dtype=torch.bfloat16)
            wt = W8.t()
            row = {"model": model, "kind": kind, "M": M, "N": N, "K": K, "flops": 2 * M * N * K}
            for name, fn in (("ours", lambda: lora_gemm(*args, silu_out=silu, out=y)),
                             ("scaled_mm", lambda: torch._scaled_mm(x8, wt, scale_a=xs[:, None], scale_b=ws[None, :],
                                                                    out_dtype=torch.bfloat16))):
                t0 = time.time()
                row[f"{name}_s"] = sustained(fn)
                if sampler is not None:
                    row[f"{name}_power"] = sampler.window(t0, time.time())
                time.sleep(1.0)
            rows.append(row)
    return rows


def layer_rate(rows: list[dict], model: str, kernel: str) -> float:
    """TFLOP/s of one layer's four GEMMs back to back at the sustained per-shape times."""
    sel = [r for r in rows if r["model"] == model]
    return sum(r["flops"] for r in sel) / sum(r[f"{kernel}_s"] for r in sel) / 1e12


def main() -> None:
    sampler = PowerSampler()
    try:
        rows = sustained_gemm_rates(sampler)
    finally:
        sampler.close()
    for r in rows:
        print(f"sustained {r['model']} {r['kind']} M={r['M']} N={r['N']} K={r['K']}: ours {r['ours_s'] * 1e6:.0f} us "
              f"({r['flops'] / r['ours_s'] / 1e12:.0f} TF/s; {describe(r.get('ours_power', {}))}), _scaled_mm "
              f"{r['scaled_mm_s'] * 1e6:.0f} us ({r['flops'] / r['scaled_mm_s'] / 1e12:.0f} TF/s; "
              f"{describe(r.get('scaled_mm_power', {}))})")
    for model in ("W1", "W4"):
        print(f"sustained {model} layer mix: ours {layer_rate(rows, model, 'ours'):.0f} TF/s, "
              f"_scaled_mm {layer_rate(rows, model, 'scaled_mm'):.0f} TF/s")


if __name__ == "__main__":
    main()
