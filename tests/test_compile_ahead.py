"""Kernels compile ahead, in parallel, at load (engine/warmup/compile_ahead.py): on a fresh Triton cache every variant
the run launches was compiled by the pool from a dry run on the shaped decoder (not the fallback after the
load), a second process compiles nothing, and f is bitwise what a run that compiles each kernel at its first
launch gives. Fresh processes, since Triton keeps compiled kernels in memory."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import SAMPLE

pytestmark = pytest.mark.gpu

SCRIPT = r"""
import json, sys
from dataclasses import asdict
from pathlib import Path
import numpy as np, triton
from policyscan.engine.warmup.compile_ahead import Variant, _marker_dir
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run import runner
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

model, policies, ahead = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
after_load, dry_run_after = [], runner._compile_after_load  # the fallback, when the shaped decoder failed
runner._compile_after_load = lambda *args: after_load.append(1) or dry_run_after(*args)
engine = Engine(model, load_policies([Path(policies)]),
                EngineSettings(device="cuda", batch_tokens=8192, compile_ahead=ahead))
misses = []

def hook(*, fn, compile, **_):  # each variant this process loads or compiles at launch
    v = Variant(fn.module, fn.name, compile["specialization_data"], str(getattr(fn.jit_function, "cache_key", "")))
    if not (_marker_dir() / v.key).exists():
        misses.append(f"{fn.name}: {compile['specialization_data']}")
    return False

triton.knobs.runtime.jit_cache_hook = hook
rng = np.random.default_rng(0)
f = []
for n, lo, hi in ((20, 5, 60), (15, 200, 600)):  # batches for CUDA graphs, then eager ones of over 4096 tokens
    convs = [rng.integers(3, 1000, int(rng.integers(lo, hi))) for _ in range(n)]
    f += engine.score_conversations(convs)[0].ravel().tolist()  # the CLI's path: policies' heads cached
print(json.dumps({"report": asdict(engine.compile) if engine.compile else None, "misses": misses, "f": f,
                  "after_load": len(after_load)}))
"""


def run(cache, ahead: bool) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, "-c", SCRIPT, str(SAMPLE / "model"), str(SAMPLE / "policies"),
                          "1" if ahead else "0"], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_compile_ahead_covers_the_run_and_keeps_the_bits(tmp_path):
    first = run(tmp_path / "cache", ahead=True)
    rep = first["report"]
    print("fresh cache:", rep)
    assert rep["compiled"] > 0 and rep["failed"] == 0 and rep["compiled"] == rep["variants"]
    assert first["misses"] == [], "variants the dry run missed:\n" + "\n".join(first["misses"])
    assert first["after_load"] == 0  # the dry run ran on the shaped decoder, before the load
    again = run(tmp_path / "cache", ahead=True)
    assert again["report"]["compiled"] == 0 and again["report"]["variants"] == rep["variants"]
    assert again["f"] == first["f"]
    as_launched = run(tmp_path / "other_cache", ahead=False)
    assert as_launched["report"] is None and as_launched["f"] == first["f"]
