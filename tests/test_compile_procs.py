"""Kernel variants compiled in child processes (engine/compile_procs.py), on a CPU with a stand-in kernel module:
every variant once, failures reported per variant and never raised, several children at work, the kernels'
modules imported as the children start (before any variant is known), and a daemonic process (a scoring worker)
may use them."""
from __future__ import annotations

import multiprocessing
import os
import time
from pathlib import Path

from policyscan.engine.compile_procs import Compilers

HERE = Path(__file__).resolve().parent


def _env(monkeypatch, out: Path) -> None:
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _compiled(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith("imported-"))


def test_each_variant_compiles_once_and_failures_are_reported(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    variants = [("fake_kernels", "kernel", f"v{i}") for i in range(9)]
    variants += [("fake_kernels", "kernel", "boom"), ("no_such_module_here", "kernel", "x")]
    with Compilers(3) as compilers:
        results = compilers.compile(variants)
    assert results[:9] == [None] * 9
    assert "cannot compile this one" in results[9] and "no_such_module_here" in results[10]
    assert _compiled(tmp_path) == sorted(f"v{i}" for i in range(9))
    assert len({(tmp_path / f"v{i}").read_text() for i in range(9)}) >= 2  # more than one child took variants


def test_children_import_the_kernels_as_they_start_and_close_unused(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    compilers = Compilers(4, ("fake_kernels",))
    deadline = time.monotonic() + 60
    while len(list(tmp_path.glob("imported-*"))) < 4 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("imported-*"))) == 4  # before any variant was sent
    assert compilers.compile([("fake_kernels", "kernel", "only")]) == [None]  # one variant: one child at work
    children = list(compilers.children)
    compilers.close()
    assert all(c.returncode == 0 for c in children) and compilers.children == []
    assert _compiled(tmp_path) == ["only"]


def test_a_child_that_dies_leaves_its_variant_uncompiled_and_the_rest_go_on(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    with Compilers(2, ("fake_kernels",)) as compilers:
        compilers.children[0].kill()
        compilers.children[0].wait()
        results = compilers.compile([("fake_kernels", "kernel", f"k{i}") for i in range(6)])
    assert sum(r is not None for r in results) <= 1  # the dead child's one variant, whose reason is given
    assert all("child process" in r for r in results if r is not None)
    assert len(_compiled(tmp_path)) == sum(r is None for r in results) >= 5


def _in_daemon(conn) -> None:
    with Compilers(2) as compilers:
        conn.send(compilers.compile([("fake_kernels", "kernel", "d0"), ("fake_kernels", "kernel", "d1")]))


def test_a_daemonic_worker_may_compile_ahead(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    parent, child = multiprocessing.Pipe()
    proc = multiprocessing.get_context("fork").Process(target=_in_daemon, args=(child,), daemon=True)
    proc.start()
    assert parent.recv() == [None, None]
    proc.join()
    assert _compiled(tmp_path) == ["d0", "d1"]


def test_kill_ends_the_children_at_once(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    compilers = Compilers(3, ("fake_kernels",))
    children = list(compilers.children)
    compilers.kill()  # a run that failed while they imported
    assert compilers.children == [] and all(c.returncode is not None for c in children)
    assert compilers.compile([("fake_kernels", "kernel", "late")]) == ["not compiled: no child process took it"]
