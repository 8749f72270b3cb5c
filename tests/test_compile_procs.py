"""Kernel variants compiled in child processes (engine/warmup/compile_procs.py), on a CPU with a stand-in kernel module:
every variant once, failures reported per variant (whatever their message holds) and never raised, several
workers at work at once, the kernels'
modules imported once as the process starts (before any variant is known) and shared by the forked workers, a
worker that dies costs only its variant, kill() ends workers in the middle of a compile, and a daemonic process
(a scoring worker) may use them."""
from __future__ import annotations

import multiprocessing
import os
import threading
import time
from pathlib import Path

from policyscan.engine.warmup.compile_procs import Compilers

HERE = Path(__file__).resolve().parent


def _env(monkeypatch, out: Path) -> None:
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))


def _compiled(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir() if not p.name.startswith(("imported-", "started-")))


def _imports(out: Path) -> list[Path]:
    return list(out.glob("imported-*"))


def _compiled_by(out: Path, names: list[str]) -> list[tuple[int, int]]:
    """(pid, parent pid) of the process that compiled each variant."""
    return [tuple(map(int, (out / n).read_text().split())) for n in names]


def _wait_for(what, seconds: float = 60) -> None:
    deadline = time.monotonic() + seconds
    while not what() and time.monotonic() < deadline:
        time.sleep(0.05)


def test_each_variant_compiles_once_and_failures_are_reported(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    variants = [("fake_kernels", "kernel", f"v{i}") for i in range(9)]
    variants += [("fake_kernels", "kernel", "boom"), ("no_such_module_here", "kernel", "x")]
    with Compilers(3) as compilers:
        results = compilers.compile(variants)
    assert results[:9] == [None] * 9
    assert results[9] == "ValueError: cannot compile this one\r\nsaid ptxas"  # as raised, lines and all
    assert "no_such_module_here" in results[10]
    assert _compiled(tmp_path) == sorted(f"v{i}" for i in range(9))
    zygote = compilers.process.pid
    by = _compiled_by(tmp_path, [f"v{i}" for i in range(9)])
    assert all(pid != zygote and parent == zygote for pid, parent in by)  # workers forked from the process


def test_the_kernels_are_imported_once_before_any_variant_and_the_workers_share_it(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    compilers = Compilers(4, ("fake_kernels",))
    _wait_for(lambda: _imports(tmp_path))
    zygote = compilers.process.pid
    assert [p.name for p in _imports(tmp_path)] == [f"imported-{zygote}"]  # before any variant
    assert compilers.compile([("fake_kernels", "kernel", f"s{i}") for i in range(8)]) == [None] * 8
    compilers.close()
    assert compilers.process.returncode == 0 and compilers.workers == []
    by = _compiled_by(tmp_path, [f"s{i}" for i in range(8)])
    assert all(pid != zygote and parent == zygote for pid, parent in by)
    assert len(_imports(tmp_path)) == 1  # the forked workers imported nothing again


def test_a_worker_that_dies_leaves_its_variant_uncompiled_and_the_rest_go_on(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    results = []
    with Compilers(2, ("fake_kernels",)) as compilers:
        # in a thread: a dead worker's pipe end kept open elsewhere would hang the compile, not fail it
        feeding = threading.Thread(target=lambda: results.extend(
            compilers.compile([("fake_kernels", "kernel", d) for d in ("k0", "die", "k1", "k2", "k3")])))
        feeding.start()
        feeding.join(timeout=60)
        assert not feeding.is_alive()
    assert results[1] == "the child process died"
    assert _compiled(tmp_path) == ["k0", "k1", "k2", "k3"] and results[0] is None and results[2:] == [None] * 3


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


def test_kill_ends_the_workers_in_the_middle_of_a_compile(monkeypatch, tmp_path):
    _env(monkeypatch, tmp_path)
    compilers = Compilers(3, ("fake_kernels",))
    results = []
    feeding = threading.Thread(target=lambda: results.extend(
        compilers.compile([("fake_kernels", "kernel", "hang")] * 3 + [("fake_kernels", "kernel", "never")])))
    feeding.start()
    _wait_for(lambda: len(list(tmp_path.glob("started-*"))) == 3)
    assert len(list(tmp_path.glob("started-*"))) == 3  # three workers at work at once
    t0 = time.monotonic()
    compilers.kill()  # a run that failed, or Ctrl-C, while they compile two-minute variants
    feeding.join(timeout=60)
    assert not feeding.is_alive() and time.monotonic() - t0 < 30
    assert compilers.workers == [] and compilers.process.returncode is not None
    assert all(r is not None for r in results) and "never" not in _compiled(tmp_path)
    assert compilers.compile([("fake_kernels", "kernel", "late")]) == ["not compiled: no child process took it"]
