"""A fitted calibration recorded in its policy's policy.json: renamed into place whole (sinks' commit), never half
written, never NaN."""
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
    path = bundle / "policy.json"
    meta = json.loads(path.read_text())
    meta["calibration"] = {"a": fit.a, "b": fit.b, "method": METHOD, **provenance}
    text = json.dumps(meta, indent=2, allow_nan=False) + "\n"  # NaN is not JSON: never written
    remove_leftovers([path])
    tmp = temp_path(path)
    try:
        tmp.write_text(text)
        commit_together([(tmp, path)], [])
    finally:
        tmp.unlink(missing_ok=True)
    return path


def data_sha256(files: list[Path]) -> str:
    """One hash of the labeled files' hashes, in the order given."""
    h = hashlib.sha256()
    for p in files:
        h.update(file_sha256(p).encode())
    return h.hexdigest()
