"""The compiling workers started at the command line's start (engine/warmup/compile_start.py): only for a run that will
compile kernels on a GPU of this process on a machine whose Triton cache holds no policyscan variant; the engine
takes them over, ends them when the run compiled before or runs on the CPU, and nothing outlives the process."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from policyscan.engine.parallel import worker_start
from policyscan.engine.warmup import compile_ahead as ca
from policyscan.engine.warmup import compile_start
from policyscan.engine.warmup.compile_procs import Compilers

HERE = Path(__file__).resolve().parent


@pytest.fixture
def one_gpu(monkeypatch, tmp_path):
    """A machine with one GPU (as the driver lists it) and a Triton cache of its own."""
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    driver = tmp_path / "driver_gpus"
    driver.mkdir()
    monkeypatch.setattr(worker_start, "NVIDIA_GPUS", driver)
    env = {"TRITON_CACHE_DIR": str(tmp_path / "triton")}
    return env, tmp_path / "triton" / "policyscan_variants"


def test_only_runs_that_will_compile_on_a_fresh_gpu_machine_start_early(one_gpu, monkeypatch):
    env, marks = one_gpu
    will = compile_start.will_compile
    assert will(["score", "x.parquet"], env) and will(["calibrate", "--labels", "l.parquet"], env)
    assert will(["score", "x", "--device", "cuda:0"], env) and will(["score", "x", "--device=cuda"], env)
    assert not will(["score", "x", "--device", "cpu"], env) and not will(["score", "x", "--device=cpu"], env)
    assert not will(["score", "x", "--ray"], env) and not will(["score", "--help"], env)
    assert not will(["inspect", "m"], env) and not will([], env) and not will(["calibrate", "--from-scores"], env)
    assert not will(["score", "x", "--workers", "2"], env)  # the worker path: each worker starts its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert not will(["score", "x"], env)  # each GPU's worker starts its own
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert not will(["score", "x"], env)  # no GPU
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setattr(worker_start, "NVIDIA_GPUS", marks.parent / "no_driver")
    assert not will(["score", "x"], env)  # CUDA_VISIBLE_DEVICES without a driver: a CPU machine
    monkeypatch.setattr(worker_start, "NVIDIA_GPUS", marks.parent.parent / "driver_gpus")
    marks.mkdir(parents=True)
    assert not will(["score", "x"], env)  # this machine compiled a run before: maybe this one
    home = {"TRITON_HOME": str(marks.parent)}
    assert compile_start.triton_cache(home) == marks.parent / ".triton" / "cache"


def _fake(monkeypatch, tmp_path) -> Path:
    out = tmp_path / "out"
    out.mkdir()
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(ca, "_marker_dir", lambda: tmp_path / "marks")
    return out


def test_the_engine_takes_the_early_workers_or_ends_them_when_the_run_compiled_before(monkeypatch, tmp_path):
    _fake(monkeypatch, tmp_path)
    early = Compilers(2, ("fake_kernels",))
    monkeypatch.setattr(compile_start, "_STARTED", [early])
    assert ca.start_compilers("run-new") is early and compile_start.take() is None  # taken once
    early.kill()
    marks = tmp_path / "marks"
    marks.mkdir()
    (marks / "k").touch()
    (marks / "run-run-old").write_text("k")
    again = Compilers(2, ("fake_kernels",))
    monkeypatch.setattr(compile_start, "_STARTED", [again])
    assert ca.start_compilers("run-old") is None
    assert again.workers == [] and again.process.returncode is not None


def test_early_workers_the_run_never_takes_end_with_the_process(monkeypatch, tmp_path):
    """A command line that fails before its engine starts (here: the input is missing) leaves no process."""
    _fake(monkeypatch, tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "triton"))
    code = ("import pathlib, sys; from policyscan.engine.warmup import compile_start as c; "
            "from policyscan.engine.parallel import worker_start as w; from policyscan.engine.warmup import "
            f"compile_procs as p; p.KERNEL_MODULES, w.NVIDIA_GPUS = ('fake_kernels',), pathlib.Path({str(tmp_path)!r}); "
            "c.prestart(['score', 'missing.parquet']); print(c._STARTED[0].process.pid, flush=True); sys.exit(2)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2, res.stderr
    pid = int(res.stdout.split()[0])
    deadline = time.monotonic() + 30
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists()
