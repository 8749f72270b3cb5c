"""Kernel variants compiled in child processes (engine/compile_procs.py), on a CPU with a stand-in kernel module:
every variant once, failures reported per variant and never raised, several children at work, and a daemonic
process (a scoring worker) may use them."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

from policyscan.engine.compile_procs import compile_variants

HERE = Path(__file__).resolve().parent


def _env(monkeypatch, out: Path) -> None:
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def test_each_variant_compiles_once_and_failures_are_reported(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    variants = [("fake_kernels", "kernel", f"v{i}") for i in range(9)]
    variants += [("fake_kernels", "kernel", "boom"), ("no_such_module_here", "kernel", "x")]
    results = compile_variants(variants, workers=3)
    assert results[:9] == [None] * 9
    assert "cannot compile this one" in results[9] and "no_such_module_here" in results[10]
    written = sorted(p.name for p in tmp_path.iterdir())
    assert written == sorted(f"v{i}" for i in range(9))
    assert len({p.read_text() for p in tmp_path.iterdir()}) >= 2  # more than one child took variants


def _in_daemon(out: str, conn) -> None:
    conn.send(compile_variants([("fake_kernels", "kernel", "d0"), ("fake_kernels", "kernel", "d1")], workers=2))


def test_a_daemonic_worker_may_compile_ahead(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_in_daemon, args=(str(tmp_path), child), daemon=True)
    proc.start()
    assert parent.recv() == [None, None]
    proc.join()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["d0", "d1"]
