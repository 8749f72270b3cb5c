"""FP8 accuracy options on a real trained model, simulated on the CPU: each candidate scheme fake-quantizes the
base weights and the base GEMMs' inputs (quantize, then dequantize in fp32) in the fp32 engine, so every option is
measured in the same frame and only its quantization differs. The LoRA shrink reads the unquantized input, as the
GPU kernels do.

    python bench/smollm2.py /tmp/smollm2 && python bench/fp8_options.py /tmp/smollm2 [--texts 30]

Reference: the fp32 engine; error = RMS(f - f_ref) / std(f_ref); flips = verdicts that change at the median of
f_ref. Prints a markdown table (the GPU's cost of each option is measured by bench/run.py, not here).
"""
from __future__ import annotations

import argparse
import sys
import types
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fp8_error import forward, pairs, setup, texts  # noqa: E402

from policyscan.engine.model import loader  # noqa: E402
from policyscan.engine.model.checkpoint import Checkpoint  # noqa: E402
from policyscan.engine.model.precision import Precision  # noqa: E402
from policyscan.kernels import reference  # noqa: E402
from policyscan.kernels.reference import FP8, FP8_MAX  # noqa: E402

Quant = Callable[[torch.Tensor], torch.Tensor]


def e4m3(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x through e4m3 with scale amax / 448 (broadcast), back in fp32."""
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (x / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * scale


def rows(x: torch.Tensor) -> torch.Tensor:
    """Per row (a weight's output channel, an activation's token): the shipped scheme."""
    x = x.float()
    return e4m3(x, x.abs().amax(-1, keepdim=True))


def groups(x: torch.Tensor, g: int = 128) -> torch.Tensor:
    """1 x g groups along K (DeepSeek-V3's activations)."""
    x = x.float()
    m, k = x.shape
    pad = (-k) % g
    xp = torch.nn.functional.pad(x, (0, pad)).reshape(m, -1, g)
    return e4m3(xp, xp.abs().amax(-1, keepdim=True)).reshape(m, -1)[:, :k]


def blocks(w: torch.Tensor, b: int = 128) -> torch.Tensor:
    """b x b blocks (DeepSeek-V3's weights)."""
    w = w.float()
    n, k = w.shape
    wp = torch.nn.functional.pad(w, (0, (-k) % b, 0, (-n) % b))
    t = wp.reshape(wp.shape[0] // b, b, wp.shape[1] // b, b)
    q = e4m3(t, t.abs().amax(dim=(1, 3), keepdim=True))
    return q.reshape(wp.shape)[:n, :k]


def fitted(w: torch.Tensor, steps: int = 32) -> torch.Tensor:
    """Per row, the scale among amax/448 * 2^(-j/steps), j < steps, that minimizes the row's squared error."""
    w = w.float()
    amax = w.abs().amax(-1, keepdim=True)
    best, err = None, None
    for j in range(steps):
        q = e4m3(w, amax * 2.0 ** (-j / steps))
        e = ((q - w) ** 2).sum(-1, keepdim=True)
        if best is None:
            best, err = q, e
        else:
            take = e < err
            best, err = torch.where(take, q, best), torch.where(take, e, err)
    return best


def two_term(q: Quant) -> Quant:
    """x ~ q(x) + q(x - q(x)): a second e4m3 term for the residual (two FP8 GEMMs)."""
    return lambda x: (lambda hi: hi + q(x.float() - hi))(q(x))


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def ident(x: torch.Tensor) -> torch.Tensor:
    return x.float()


OPTIONS: dict[str, tuple[Quant, Quant]] = {  # name: (weight quantizer, activation quantizer)
    "per-channel W, per-token A (shipped)": (rows, rows),
    "per-channel W, 1x128 A": (rows, groups),
    "128x128 W, per-token A": (blocks, rows),
    "128x128 W, 1x128 A (DeepSeek-V3)": (blocks, groups),
    "MSE-fitted per-channel W, per-token A": (fitted, rows),
    "two-term W, per-token A": (two_term(rows), rows),
    "per-channel W, two-term A": (rows, two_term(rows)),
    "two-term W, two-term A": (two_term(rows), two_term(rows)),
    "MSE-fitted per-channel W, 1x128 A": (fitted, groups),
    "bf16 W, 1x128 A": (bf16, groups),
    "per-channel W, bf16 A": (rows, bf16),
    "bf16 W, per-token A": (bf16, rows),
    "bf16 W, bf16 A": (bf16, bf16),
}


SMOOTHED = {  # SmoothQuant's migration: x / s and W * s per input channel, s = amax_x^a / amax_W^(1-a)
    "SmoothQuant a=0.5, per-channel W, per-token A": (rows, rows, 0.5),
    "SmoothQuant a=0.5, per-channel W, 1x128 A": (rows, groups, 0.5),
    "SmoothQuant a=0.3, per-channel W, 1x128 A": (rows, groups, 0.3),
}


def ops_with(act: Quant, smooth: dict | None = None, seen: dict | None = None) -> types.ModuleType:
    """The reference ops with the base GEMM's input fake-quantized (16-bit path: x_scale is None). smooth: the
    input's per-channel divisor by its weight's data_ptr; seen: collects each weight's input channel maxima."""
    ops = types.ModuleType("reference_fake_quant")
    ops.__dict__.update(reference.__dict__)

    def lora_gemm(x, x_scale, W, *args, **kw):
        key = W.data_ptr()
        if seen is not None:
            amax = x.float().abs().amax(0)
            seen[key] = torch.maximum(seen[key], amax) if key in seen else amax
        if smooth is not None and key in smooth:
            s = smooth[key]
            return reference.lora_gemm((act(x.float() / s) * s).to(x.dtype), x_scale, W, *args, **kw)
        return reference.lora_gemm(act(x).to(x.dtype), x_scale, W, *args, **kw)

    ops.lora_gemm = lora_gemm
    return ops


def decoder(ckpt: Checkpoint, pols, labels, weight: Quant, act: Quant):
    """The fp32 decoder with base weights through `weight` (the loader's fp8 route, dequantized) and inputs
    through `act`."""
    saved = loader.quantize_weight, loader.dequantize_weight
    loader.quantize_weight = lambda w: (weight(w), None)
    loader.dequantize_weight = lambda w, scale, dtype: w.to(dtype)
    try:
        d = loader.load_decoder(ckpt, ops_with(act), Precision(torch.float32, fp8_weights=True))
    finally:
        loader.quantize_weight, loader.dequantize_weight = saved
    loader.attach_policies(d, pols, labels)
    return d


def smoothed(ckpt: Checkpoint, pols, labels, calib: tuple[list, list], weight: Quant, act: Quant, alpha: float):
    """The fp32 decoder with each projection's input channels migrated into its weight (SmoothQuant), from the
    channel maxima of a calibration pass on other texts; the product is unchanged before quantization."""
    seen: dict = {}
    d = loader.load_decoder(ckpt, ops_with(ident, seen=seen), Precision(torch.float32))
    loader.attach_policies(d, pols, labels)
    forward(d, *calib)
    smooth = {}
    for layer in d.layers:
        for group in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, group)
            w = lin.weight.float()
            s = (seen[w.data_ptr()].clamp_min(1e-5) ** alpha / w.abs().amax(0).clamp_min(1e-5) ** (1 - alpha))
            lin.weight = (weight(w * s) / s).to(lin.weight.dtype)
            smooth[lin.weight.data_ptr()] = s
    ops = ops_with(act, smooth=smooth)
    for layer in d.layers:
        for group in ("qkv", "o", "gate_up", "down"):
            getattr(layer, group).ops = ops
    return d


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--texts", type=int, default=30)
    ap.add_argument("--only", default=None, help="substrings of option names, separated by |")
    args = ap.parse_args()
    ckpt, pols, eng, seqs, ads, labels = setup(args.model, args.texts)
    ref = forward(eng.decoder, seqs, ads)
    med = np.median(ref)
    print(f"{len(seqs)} (conversation, policy) pairs, f_ref std {ref.std():.3f}\n", file=sys.stderr)
    print("| option | error | flips at the median |\n|---|---|---|")

    def report(name: str, f: np.ndarray) -> None:
        err = np.sqrt(np.mean((f - ref) ** 2)) / ref.std()
        print(f"| {name} | {err:.3f} | {int(((f > med) != (ref > med)).sum())} |", flush=True)

    for name, (wq, aq) in OPTIONS.items():
        if args.only and not any(s in name for s in args.only.split("|")):
            continue
        report(name, forward(decoder(ckpt, pols, labels, wq, aq), seqs, ads))
    calib = pairs(eng, texts(args.texts + 30)[args.texts:])
    for name, (wq, aq, alpha) in SMOOTHED.items():
        if args.only and not any(s in name for s in args.only.split("|")):
            continue
        report(name, forward(smoothed(ckpt, pols, labels, calib, wq, aq, alpha), seqs, ads))


if __name__ == "__main__":
    main()
