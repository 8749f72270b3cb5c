"""How an engine computes: decided once by the Engine from the settings, the device and the checkpoint, then passed
to the loader (which layer class, which weight dtype) and the decoder (which rope tables)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from policyscan.engine.policy.bundle import Policy


@dataclass(frozen=True)
class Precision:
    """dtype: activations, norms, LoRA factors, embeddings and the residual stream.
    fp8_weights: base weights through e4m3 with per-output-channel scales (an FP8 checkpoint's, else quantized).
    w8a8: those weights kept e4m3 and activations quantized per token (layers.Fp8LoraLinear); without it they are
    dequantized to `dtype` at load."""

    dtype: torch.dtype
    fp8_weights: bool = False
    w8a8: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"the compute dtype is float32 or bfloat16, got {self.dtype}")
        if self.w8a8 and not self.fp8_weights:
            raise ValueError("W8A8 multiplies FP8 weights: it needs fp8_weights")
        if self.w8a8 and self.dtype != torch.bfloat16:
            raise ValueError(f"W8A8 is the GPU kernels' arithmetic, with bf16 activations, not {self.dtype}")

    def record(self) -> dict:
        """What the outputs' metadata records of the arithmetic, all that `from_record` needs to repeat it."""
        return {"dtype": str(self.dtype).removeprefix("torch."), "fp8_weights": self.fp8_weights, "w8a8": self.w8a8}

    @classmethod
    def from_record(cls, rec: dict) -> "Precision":
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}.get(rec.get("dtype"))
        if dtype is None:
            raise ValueError(f"recorded numerics name no known compute dtype: {rec!r}")
        return cls(dtype, bool(rec.get("fp8_weights")), bool(rec.get("w8a8")))

    @property
    def name(self) -> str:
        """What the outputs' metadata records: fp8 whenever the base weights went through e4m3."""
        return "fp8" if self.fp8_weights else "bf16" if self.dtype == torch.bfloat16 else "fp32"

    def __str__(self) -> str:  # summaries print an engine's precision as the name the metadata records
        return self.name

    @property
    def packed_rope(self) -> bool:
        """Rope tables rounded to fp16 and packed (reference.rope_tables) for the qkv GEMM's epilogue, with W8A8 only:
        e4m3's per-token rounding (2^-4) dwarfs fp16's (2^-12). 16-bit activations keep exact tables: with fp16 ones
        a bf16 engine's max |dp| against HF fp64 grew by up to about twice on test_gpu_engine's models
        (docs/performance.md)."""
        return self.w8a8


def decide_precision(requested: str, gpu: bool, checkpoint_fp8: bool, policies: list[Policy],
                     flip_limit: float) -> tuple[Precision, str | None]:
    """The engine's precision, and why --precision auto did not take FP8 on a GPU (None when it did, or was not
    asked). An FP8 checkpoint is always FP8: computing in 16 bits would not make its weights more precise. FP8 asked
    for on the CPU runs the GPU's W8A8 in its torch twins (a preview without a GPU); an FP8 checkpoint under auto
    is dequantized to fp32 there, as the README says."""
    name, reason = choose_precision(requested, gpu, policies, flip_limit)
    if checkpoint_fp8 and name != "fp8":
        name, reason = "fp8", None  # the checkpoint decided, not a policy's FP8 check
    w8a8 = name == "fp8" and (gpu or requested == "fp8")
    dtype = torch.bfloat16 if w8a8 or name == "bf16" else torch.float32
    return Precision(dtype, fp8_weights=name == "fp8", w8a8=w8a8), reason


def choose_precision(requested: str, gpu: bool, policies: list[Policy], limit: float) -> tuple[str, str | None]:
    """(precision, why auto did not take FP8 on a GPU, or None). auto: FP8 on a GPU unless a policy's recorded
    FP8 check (calibrate) flipped more than `limit` of its labeled verdicts, then bf16; fp32 on the CPU."""
    if requested != "auto":
        return requested, None
    if not gpu:
        return "fp32", None
    over = [(p.name, c["flip_share"]) for p in policies
            if (c := p.calibration.get("fp8_check") or {}).get("flip_share", 0.0) > limit]
    if not over:
        return "fp8", None
    return "bf16", ("FP8 flipped " + ", ".join(f"{s:.1%} of {n}'s labeled verdicts" for n, s in over)
                    + f" (calibrate's check; limit {limit:.0%})")
