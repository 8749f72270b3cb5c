"""The trained adapter into the policy folder: written into a staging folder beside it, scored through `score`'s
engine on the holdout and compared with the trainer's own f (train/serve parity), calibrated on the holdout,
checked FP8 against bf16, recorded, and only then renamed into place, all files together (a failure or Ctrl-C
before that leaves the folder as it was)."""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from policyscan.calibration.metrics import average_precision, log_loss, roc_auc
from policyscan.calibration.platt import PlattFit, fit_platt
from policyscan.calibration.precision_check import flip_record
from policyscan.calibration.record import METHOD
from policyscan.calibration.thresholds import at_threshold
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.outputs.sinks import commit_together
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.training.data import Example

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
FP32_BOUND = 1e-4  # |f_score - f_train| in fp32: the engine-against-HF bound of the fp32 tests
# In bf16 and FP8 both the trainer and the engine round: score's f may be at most twice as far from the fp32
# computation of the same adapter (and the same FP8 numerics) as the trainer's 16-bit f is, the bound the GPU
# engine-against-HF tests use.
FACTOR_16 = 2.0


@dataclass(frozen=True)
class Parity:
    max_abs: float          # largest |f_score - f_train|
    score_vs_fp32: float    # largest |f_score - f_fp32|
    train16_vs_fp32: float | None  # largest |f_train(16-bit) - f_fp32|; None in fp32
    bound: float
    first_row: str | None   # the row furthest past the bound, if any

    @property
    def ok(self) -> bool:
        return self.first_row is None

    def describe(self) -> str:
        if self.train16_vs_fp32 is None:
            return f"largest |f_score - f_train| {self.max_abs:.3g} (bound {self.bound:.3g})"
        return (f"largest |f_score - f_fp32| {self.score_vs_fp32:.3g}, the trainer's 16-bit "
                f"{self.train16_vs_fp32:.3g} (bound {self.bound:.3g}); |f_score - f_train| {self.max_abs:.3g}")

    def record(self) -> dict:
        return {"max_abs_diff": self.max_abs, "score_vs_fp32": self.score_vs_fp32,
                "train16_vs_fp32": self.train16_vs_fp32, "bound": self.bound}


def staging(policy_dir: Path) -> Path:
    """A fresh folder beside the policy's for the new bundle (same file system: renames are atomic)."""
    stage = policy_dir.parent / f".{policy_dir.name}.train-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    shutil.copy2(policy_dir / "policy.json", stage / "policy.json")
    return stage


def parity(engine: Engine, holdout: list[Example], f_train: np.ndarray, f_ref: np.ndarray,
           f_16: np.ndarray | None) -> tuple[Parity, np.ndarray]:
    """The holdout through `score`'s engine against the trainer; (the check, the engine's f). fp32 (f_16 None):
    within FP32_BOUND of the trainer. 16-bit: no further from the fp32 computation than FACTOR_16 times the
    trainer's own 16-bit f is."""
    f_engine = engine.score([list(e.ids) for e in holdout], np.zeros(len(holdout), dtype=np.int64)).astype(np.float64)
    to_ref = np.abs(f_engine - f_ref)
    if f_16 is None:
        dev, bound, train16 = np.abs(f_engine - f_train), FP32_BOUND, None
    else:
        train16 = float(np.abs(f_16 - f_ref).max())
        dev, bound = to_ref, FACTOR_16 * train16 + 1e-6
    worst = int(np.argmax(dev))
    first = holdout[worst].where if dev[worst] > bound else None
    return Parity(float(np.abs(f_engine - f_train).max()), float(to_ref.max()), train16, bound, first), f_engine


def holdout_metrics(p: np.ndarray, y: np.ndarray, threshold: float) -> dict:
    """log loss, ROC AUC, PR AUC and F1 at the policy's threshold on the held-out rows (null where one class)."""
    yb = y.astype(bool)
    both = 0 < yb.sum() < len(yb)
    return {"log_loss": log_loss(p, yb), "roc_auc": roc_auc(p, yb) if both else None,
            "pr_auc": average_precision(p, yb) if both else None, "f1": at_threshold(p, yb, threshold)["f1"],
            "threshold": threshold, "rows": int(len(yb)), "positives": int(yb.sum())}


def calibrate(f: np.ndarray, y: np.ndarray) -> PlattFit:
    try:
        return fit_platt(f, y.astype(bool))
    except ValueError as e:
        raise PolicyscanError(f"cannot calibrate the trained policy on its holdout: {e}") from e


def fp8_check(model_dir: Path, stage: Path, settings: EngineSettings, holdout: list[Example], fit: PlattFit,
              threshold: float) -> dict:
    """What calibrate records for --precision auto: the share of holdout verdicts that flip between FP8 and bf16
    with the new calibration, and the largest |dp| (the CPU runs FP8 in the GPU's twins)."""
    p, device = {}, None
    prompts = [list(e.ids) for e in holdout]
    for precision in ("fp8", "bf16"):
        engine = Engine(model_dir, [load_policy(stage)], dataclasses.replace(settings, precision=precision))
        p[precision], device = fit(engine.score(prompts, np.zeros(len(prompts), dtype=np.int64))), str(engine.device)
        del engine
    return flip_record(p["fp8"], p["bf16"], threshold, device)


def write_record(stage: Path, fit: PlattFit, calibration: dict, check: dict, training: dict) -> None:
    meta = json.loads((stage / "policy.json").read_text())
    meta["calibration"] = {"a": fit.a, "b": fit.b, "method": METHOD, **calibration, "fp8_check": check}
    meta["training"] = training
    (stage / "policy.json").write_text(json.dumps(meta, indent=2, allow_nan=False) + "\n")


def commit(stage: Path, policy_dir: Path) -> None:
    """The staged adapter files and policy.json renamed into the policy folder together (sinks' commit: on a
    failure the old files are put back)."""
    moves = [(stage / name, policy_dir / name) for name in (*ADAPTER_FILES, "policy.json")]
    commit_together(moves, [])
    shutil.rmtree(stage, ignore_errors=True)
