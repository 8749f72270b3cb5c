"""compile_ahead's bookkeeping on a CPU (engine/warmup/compile_ahead.py), its dry run stood in for by fake variants of
tests/fake_kernels.py: the variants compile in the background as the dry run meets them, markers and a manifest
record them, a second run reports them cached without a dry run and closes the children it was given, a variant
that fails leaves no manifest, and cancel() ends the children."""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest

from policyscan.engine.warmup import compile_ahead as ca
from policyscan.engine.warmup import compile_procs
from policyscan.engine.warmup.compile_procs import Compilers

HERE = Path(__file__).resolve().parent


@pytest.fixture
def fake(monkeypatch, tmp_path):
    out, marks = tmp_path / "out", tmp_path / "marks"
    out.mkdir()
    monkeypatch.setenv("FAKE_OUT", str(out))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setattr(ca, "_marker_dir", lambda: marks)
    monkeypatch.setattr(compile_procs, "KERNEL_MODULES", ("fake_kernels",))
    runs = []

    def dry_run(decoder, heads, shapes, offer):
        runs.append(len(shapes))
        variants = [ca.Variant("fake_kernels", "kernel", data, "src") for data in decoder]
        for v in variants:
            offer(v)
        return variants
    monkeypatch.setattr(ca, "dry_run", dry_run)
    return out, marks, runs


def _job(variants: list[str], run_id: str, compilers: Compilers | None = None) -> ca.CompileJob:
    return ca.compile_ahead(variants, [], 8192, False, run_id, compilers)  # the fake dry run's "decoder": the data


def test_variants_compile_in_the_background_then_a_second_run_finds_them_cached(fake):
    out, marks, runs = fake
    job = _job([f"v{i}" for i in range(5)], "run-a", Compilers(2, ("fake_kernels",)))
    assert isinstance(job, ca.CompileJob)  # returned before the compiling is waited for
    report = job.wait()
    assert (report.variants, report.compiled, report.failed, report.workers) == (5, 5, 0, 2)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("v")) == [f"v{i}" for i in range(5)]
    assert (marks / "run-run-a").read_text().split() == [ca.Variant("fake_kernels", "kernel", f"v{i}", "src").key
                                                         for i in range(5)]
    given = Compilers(2, ("fake_kernels",))
    again = _job(["never", "asked"], "run-a", given).wait()
    assert (again.variants, again.compiled, again.failed) == (5, 0, 0) and runs == [runs[0]]  # no dry run
    assert given.workers == [] and given.process.returncode is not None


def test_variants_compile_while_the_dry_run_goes_on(fake, monkeypatch):
    """Each variant goes to a worker as the dry run meets it, not when the dry run ends."""
    out = fake[0]
    seen_during = []

    def dry_run(decoder, heads, shapes, offer):
        first = ca.Variant("fake_kernels", "kernel", "early", "src")
        offer(first)
        deadline = time.monotonic() + 60
        while not (out / "early").exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        seen_during.append((out / "early").exists())
        later = ca.Variant("fake_kernels", "kernel", "late", "src")
        offer(later)
        return [first, later]
    monkeypatch.setattr(ca, "dry_run", dry_run)
    report = _job([], "run-s", Compilers(2, ("fake_kernels",))).wait()
    assert seen_during == [True] and (report.variants, report.compiled, report.failed) == (2, 2, 0)


def test_children_given_when_nothing_is_left_to_compile_are_ended_at_once(fake):
    _job(["m0", "m1"], "run-e").wait()
    (fake[1] / "run-run-e").unlink()  # the manifest gone (another configuration), every variant still marked
    given = Compilers(3, ("fake_kernels",))
    job = _job(["m0", "m1"], "run-e", given)
    assert given.workers == [] and given.process.returncode is not None  # before the load, not after
    assert (job.wait().compiled, (fake[1] / "run-run-e").exists()) == (0, True)


def test_a_variant_that_fails_is_counted_and_leaves_no_manifest(fake):
    out, marks, _ = fake
    report = _job(["ok1", "boom", "ok2"], "run-b").wait()  # no children given: started for the variants
    assert (report.variants, report.compiled, report.failed) == (3, 2, 1)
    assert not (marks / "run-run-b").exists()
    rerun = _job(["ok1", "boom", "ok2"], "run-b").wait()  # only the failed one is tried again
    assert (rerun.compiled, rerun.failed, rerun.workers) == (0, 1, 1)


def test_cancel_ends_the_children_while_they_compile(fake):
    job = _job([f"c{i}" for i in range(50)], "run-c", Compilers(2, ("fake_kernels",)))
    t0 = time.monotonic()
    job.cancel()
    report = job.wait()
    assert time.monotonic() - t0 < 30 and report.compiled < 50 and report.failed == 50 - report.compiled


def test_the_engine_never_fails_for_compile_ahead_and_keeps_its_children_for_the_fallback(fake, monkeypatch):
    """runner's two steps: a shaped decoder that cannot be built leaves the children to the dry run after the
    load; a compile-ahead that fails after the load reports nothing and ends them (the kernels then compile at
    launch)."""
    from policyscan.engine.run import runner
    from policyscan.engine.settings import EngineSettings

    def no_shapes(*args):
        raise RuntimeError("cannot build it")
    monkeypatch.setattr(runner, "shaped_decoder", no_shapes)
    given = Compilers(2, ("fake_kernels",))
    assert runner._compile_on_shapes(None, None, None, [], [], [], EngineSettings(), "run-f", given) is None
    assert len(given.workers) == 2 and given.process.poll() is None
    report = runner._compile_after_load(["f0"], [], EngineSettings("cpu"), "run-f", given)
    assert report.compiled == 1 and given.workers == []

    def broken(*args, **kwargs):
        raise PermissionError("policyscan_variants: not searchable")
    monkeypatch.setattr(runner, "compile_ahead", broken)
    again = Compilers(1, ("fake_kernels",))
    assert runner._compile_after_load(["f1"], [], EngineSettings(), "run-g", again) is None and again.workers == []


class _Held:
    """Compilers' stand-in whose one worker takes nothing until `go` is set, then takes every variant in turn."""

    def __init__(self):
        self.workers, self.go, self.took = [None], threading.Event(), []

    def compile(self, variants):
        self.go.wait(60)
        self.took = [data for _, _, data in variants]
        return [None] * len(self.took)

    def close(self):
        pass

    def kill(self):
        pass


def test_of_the_variants_waiting_the_slowest_kernels_are_handed_out_first(fake):
    names = ["_rope_kernel", "_attn_kernel", "_lora_gemm_ws_kernel", "_head_kernel", "_lora_gemm_ws_kernel"]
    held = _Held()
    job = ca.CompileJob("run-h", held, time.perf_counter())
    for i, n in enumerate(names):
        job.offer(ca.Variant("fake_kernels", n, f"d{i}", "src"))
    job.finish(None)  # a dry run that failed: what was offered still compiles, but no manifest
    held.go.set()
    report = job.wait()
    assert held.took == ["d2", "d4", "d1", "d0", "d3"]  # the rest keep the dry run's order
    assert (report.variants, report.compiled) == (5, 5) and not (fake[1] / "run-run-h").exists()


def test_ctrl_c_in_the_compile_after_the_load_ends_the_workers(fake, monkeypatch):
    from policyscan.engine.run import runner
    from policyscan.engine.settings import EngineSettings

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(runner, "compile_ahead", interrupted)
    given = Compilers(2, ("fake_kernels",))
    with pytest.raises(KeyboardInterrupt):
        runner._compile_after_load(["k0"], [], EngineSettings(), "run-i", given)
    assert given.workers == [] and given.process.returncode is not None


def test_the_run_id_hashes_every_engine_and_kernel_module():
    """A change to any module that decides kernel variants (a launcher, a tile, a batch plan) gives a new run id,
    so a manifest written by other code is not trusted: variants_id hashes these files."""
    files = ca.source_files()
    package = Path(ca.__file__).resolve().parents[2]
    names = {str(f.relative_to(package)) for f in files}
    assert {"kernels/attention.py", "kernels/tuning.py", "engine/run/batch.py", "engine/model/layers.py",
            "engine/warmup/compile_ahead.py"} <= names, sorted(names)
    assert names >= {str(f.relative_to(package)) for f in (package / "engine").rglob("*.py")}
