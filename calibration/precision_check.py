"""FP8 against bf16 on a policy's labeled rows: the share of verdicts that flip at its threshold and the largest
|dp|, which `calibrate` records in policy.json and `--precision auto` reads (engine/runner.choose_precision)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from policyscan.engine.policy import Policy
from policyscan.engine.runner import Engine, EngineSettings


def fp8_check(model_dir: Path, policy: Policy, settings: EngineSettings, convs: list[np.ndarray], a: float,
              b: float) -> dict:
    """p in FP8 and in bf16 on the same device with the new a, b (the CPU runs the GPU's W8A8 in its twins)."""
    p, device = {}, None
    for precision in ("fp8", "bf16"):
        engine = Engine(model_dir, [policy], dataclasses.replace(settings, precision=precision))
        f = engine.score_conversations(convs)[0][:, 0].astype(np.float64)
        p[precision], device = 1.0 / (1.0 + np.exp(-(a * f + b))), str(engine.device)
        del engine
    flips = (p["fp8"] >= policy.threshold) != (p["bf16"] >= policy.threshold)
    return {"flip_share": float(flips.mean()), "max_dp": float(np.abs(p["fp8"] - p["bf16"]).max()),
            "rows": len(convs), "device": device}
