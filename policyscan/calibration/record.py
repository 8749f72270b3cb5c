"""A fitted calibration, or a chosen threshold, recorded in its policy's policy.json: renamed into place whole
(sinks' commit), never half written, never NaN."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np

from policyscan.calibration.platt import PlattFit
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.files import file_sha256
from policyscan.engine.outputs.sinks import commit_together, remove_leftovers, temp_path

METHOD = "platt-newton (Lin, Lin & Weng 2007)"


def write_calibration(bundle: Path, fit: PlattFit, provenance: dict) -> Path:
    """policy.json's `calibration` replaced by a, b, the method and `provenance`; the other keys kept."""
    if not np.isfinite([fit.a, fit.b]).all():
        raise PolicyscanError("calibration produced non-finite parameters; policy.json left unchanged")
    return update_policy_json(bundle, {"calibration": {"a": fit.a, "b": fit.b, "method": METHOD, **provenance}})


def write_threshold(bundle: Path, threshold: float, choice: dict) -> Path:
    """policy.json's `threshold` set, and `threshold_choice` (how it was chosen: target, data, achieved figures)
    replaced; the other keys kept."""
    if not 0.0 < threshold < 1.0:
        raise PolicyscanError(f"threshold {threshold} is outside (0, 1); policy.json left unchanged")
    return update_policy_json(bundle, {"threshold": threshold, "threshold_choice": choice})


def update_policy_json(bundle: Path, keys: dict) -> Path:
    """policy.json with `keys` set, written whole under a temporary name and renamed into place (sinks' commit)."""
    path = bundle / "policy.json"
    meta = json.loads(path.read_text())
    meta.update(keys)
    text = json.dumps(meta, indent=2, allow_nan=False) + "\n"  # NaN is not JSON: never written
    write_atomic(path, text)
    return path


def write_atomic(path: Path, text: str) -> None:
    """`text` into `path`: a reader sees the old file or the new one, never half of one."""
    remove_leftovers([path])
    tmp = temp_path(path)
    try:
        tmp.write_text(text, encoding="utf-8")
        commit_together([(tmp, path)], [])
    finally:
        tmp.unlink(missing_ok=True)


def data_sha256(files: list[Path]) -> str:
    """One hash of the labeled files' hashes, in the order given."""
    h = hashlib.sha256()
    for p in files:
        h.update(file_sha256(p).encode())
    return h.hexdigest()
