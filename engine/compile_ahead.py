"""Compile a run's GPU kernel variants in parallel before its first batch.

Triton compiles a kernel variant the first time a process launches it, one after another inside the first
batches: on a fresh machine W1 spent 28 s more than a warm run compiling, and an 8-row file compiled the
small-batch variants again. Here a dry run of the decoder (the prefixes' prefill, one eager batch per
specialization class, each CUDA-graph bucket) launches nothing: every Triton launch runs as a warm-up, and
Triton's jit_cache_hook records each variant this process has not loaded yet and skips its compile. Variants
that no earlier run compiled go to a pool of processes that compile them into Triton's disk cache at once; the
real batches then load them from disk. The dry run computes nothing that is kept, and a variant it missed
compiles when first launched, as before: what a run computes does not change, only when kernels compile.

A marker per variant beside Triton's cache (policyscan_variants/) says it compiled there, so a warm machine
starts no pool, and a manifest per run configuration lists its variants, so a repeated nightly run skips the dry
run too (1.6 s at W1); wiping Triton's cache wipes both with it."""
from __future__ import annotations

import hashlib
import importlib
import multiprocessing
import os
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from policyscan.engine.graphs import GraphedForward, static_batch
from policyscan.engine.model import Decoder


@dataclass(frozen=True)
class Variant:
    module: str  # the kernel's module and name: what a worker process imports
    name: str
    data: str    # Triton's serialized specialization (JITFunction.preload takes it)

    @property
    def key(self) -> str:
        return hashlib.sha256(f"{self.module}.{self.name}\0{self.data}".encode()).hexdigest()


@dataclass(frozen=True)
class CompileReport:
    variants: int   # variants the dry run met
    compiled: int   # of them compiled ahead in the pool (none on a warm machine)
    failed: int     # that the pool could not compile: they compile when first launched
    workers: int
    seconds: float

    def describe(self) -> str:
        if not self.compiled and not self.failed:
            return f"{self.variants} kernel variants cached"
        failed = f", {self.failed} left to compile when launched" if self.failed else ""
        return f"{self.compiled} of {self.variants} kernel variants compiled in {self.workers} processes{failed}"


def shape_classes(batch_tokens: int, graphs: bool) -> list[tuple[int, int]]:
    """(tokens, sequences) of the dry run's batches. Triton specializes integer arguments on divisibility by 16,
    and the GEMM's kernel and tiles follow its rows (kernels/tuning.py: <= 256, <= 2048 with N-dependent tiles,
    the Gluon kernel from 1025): a batch's tokens in each class and both parities, and since the last layer runs
    its sequences' last tokens only, its sequences too. Eager batches are those over the CUDA graphs' range; the
    graphs' buckets (tokens, and 8 or 16+ sequence slots) each once."""
    low = GraphedForward.MAX_TOKENS + 16 if graphs else 16
    sizes = [m + d for m in (64, 512, 1040, 2112, low) for d in (0, 1) if low <= m <= batch_tokens - 1]
    seqs = [1] + [b + d for b in (64, 320, 512, 704, 1040, 2112) for d in (0, 1)]  # 1: Triton specializes it too
    eager = [(t, b) for t in sorted(set(sizes)) for b in (64, 63) if b <= t]
    eager += [(max(sizes), b) for b in seqs if b <= max(sizes)] if sizes else []
    eager = list(dict.fromkeys(eager))
    if not graphs:
        return eager
    buckets, t = [], GraphedForward.MIN_TOKENS
    while t <= min(GraphedForward.MAX_TOKENS, batch_tokens):
        buckets += [(t, 8), (t, 16)]
        t *= 2
    return eager + buckets


def compile_ahead(decoder: Decoder, heads: list[list[int]], batch_tokens: int, graphs: bool, run_id: str,
                  max_workers: int = 16) -> CompileReport:
    """The dry run, then the pool for the variants no marker covers (see the module docstring). run_id names
    everything that decides the variants (model, precision, policies, settings, kernel sources: variants_id);
    a run whose id compiled before, its every variant still marked, skips the dry run too."""
    t0 = time.perf_counter()
    marks = _marker_dir()
    manifest = marks / f"run-{run_id}"
    try:
        known = manifest.read_text().split()
        if known and all((marks / k).exists() for k in known):
            return CompileReport(len(known), 0, 0, 0, time.perf_counter() - t0)
    except OSError:
        pass
    variants = _dry_run(decoder, heads, shape_classes(batch_tokens, graphs))
    if variants is None:  # this Triton's hook gives no serialized specialization: compile as launched
        return CompileReport(0, 0, 0, 0, time.perf_counter() - t0)
    todo = [v for v in variants if not (marks / v.key).exists()]
    workers = min(len(todo), max_workers, os.cpu_count() or 1)
    failed = 0
    if todo:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            futures = [(v, pool.submit(_preload, v.module, v.name, v.data)) for v in todo]
            for v, fut in futures:
                try:
                    fut.result()
                except Exception:  # noqa: BLE001  a failed compile fails again, with its message, at launch
                    failed += 1
                    continue
                marks.mkdir(parents=True, exist_ok=True)
                (marks / v.key).touch()
    if not failed:
        try:
            marks.mkdir(parents=True, exist_ok=True)
            manifest.write_text("\n".join(v.key for v in variants))
        except OSError:
            pass
    return CompileReport(len(variants), len(todo) - failed, failed, workers, time.perf_counter() - t0)


def variants_id(*parts: object) -> str:
    """A hash of what decides a run's kernel variants (compile_ahead's run_id): the caller's parts, Triton's
    version and the source of policyscan's kernels."""
    import triton

    h = hashlib.sha256(repr((triton.__version__, parts)).encode())
    for f in sorted((Path(__file__).resolve().parent.parent / "kernels").glob("*.py")):
        h.update(f.read_bytes())
    return h.hexdigest()[:32]


def _preload(module: str, name: str, data: str) -> None:
    """In a pool process: compile one variant into Triton's disk cache."""
    getattr(importlib.import_module(module), name).preload(data)


def _marker_dir() -> Path:
    import triton

    return Path(triton.knobs.cache.dir) / "policyscan_variants"


def _dry_run(decoder: Decoder, heads: list[list[int]], shapes: list[tuple[int, int]]) -> list[Variant] | None:
    seen: dict[str, Variant] = {}
    missing = []
    with _record(seen, missing), torch.inference_mode():
        prefix = decoder.prefill_prefixes(heads)
        for t, b in shapes:
            decoder.forward(static_batch(t, b, decoder.device), prefix)
        torch.cuda.synchronize(decoder.device)
    return None if missing else list(seen.values())


@contextmanager
def _record(seen: dict[str, Variant], missing: list):
    """Every Triton launch in the block runs as a warm-up (nothing launches); each variant not loaded in this
    process is recorded and its compile skipped."""
    import triton
    from triton.runtime.jit import JITFunction

    def hook(*, fn, compile, **_):
        data = compile.get("specialization_data")
        if data is None:
            missing.append(fn.name)
        else:
            v = Variant(fn.module, fn.name, data)
            seen.setdefault(v.key, v)
        return True  # skip: the pool compiles it

    run, old_hook = JITFunction.run, triton.knobs.runtime.jit_cache_hook

    def warmup_only(self, *args, grid, warmup, **kwargs):
        return run(self, *args, grid=grid, warmup=True, **kwargs)

    JITFunction.run, triton.knobs.runtime.jit_cache_hook = warmup_only, hook
    try:
        yield
    finally:
        JITFunction.run, triton.knobs.runtime.jit_cache_hook = run, old_hook
