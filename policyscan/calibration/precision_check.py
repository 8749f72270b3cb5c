"""FP8 against bf16 on a policy's labeled rows: the share of verdicts that flip at its threshold and the largest
|dp|, which `calibrate` records in policy.json and `--precision auto` reads (engine/precision.choose_precision)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from policyscan.calibration.labeled import score_labeled
from policyscan.engine.inputs.sources import ReadSpec
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings


def fp8_check(model_dir: Path, policy: Policy, settings: EngineSettings, files: list[Path], spec: ReadSpec,
              label_column: str | None, a: float, b: float) -> dict:
    """p in FP8 and in bf16 on the same device with the new a, b (the CPU runs the GPU's W8A8 in its twins); the
    labeled files are read again for each, chunk by chunk, so that no precision holds every row."""
    p, device = {}, None
    for precision in ("fp8", "bf16"):
        engine = Engine(model_dir, [policy], dataclasses.replace(settings, precision=precision))
        f = score_labeled(engine, files, spec, label_column).f
        p[precision], device = 1.0 / (1.0 + np.exp(-(a * f + b))), str(engine.device)
        del engine
    return flip_record(p["fp8"], p["bf16"], policy.threshold, device)


def flip_record(p_fp8: np.ndarray, p_bf16: np.ndarray, threshold: float, device: str) -> dict:
    """What policy.json's `fp8_check` holds: the share of verdicts that flip at `threshold`, the largest |dp|."""
    flips = (p_fp8 >= threshold) != (p_bf16 >= threshold)
    return {"flip_share": float(flips.mean()), "max_dp": float(np.abs(p_fp8 - p_bf16).max()),
            "rows": len(p_fp8), "device": device}
