"""Where a fresh machine's compile time goes (docs/performance.md): a workload's kernel variants, as the
engine's compile-ahead dry run finds them (engine/warmup/compile_ahead.py), compiled into an empty Triton cache by
the engine's compiling workers (engine/warmup/compile_procs.py), each variant timed.

Prints: a process's import of the kernels alone (one, and --workers at once, as spawned compiling workers would);
then, the workers started and their import done first (as the engine starts them before its model load), each
variant's compile seconds, the slowest, their sum, and the makespan in the dry run's order against the
longest-first order's.

    python bench/compile_times.py --workload W1 [--dir /tmp/e2e] [--workers 16]"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="triton_times_")  # before triton is imported

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import prepare  # noqa: E402

from policyscan.engine.policy.bundle import load_policies  # noqa: E402
from policyscan.engine.run.runner import Engine  # noqa: E402
from policyscan.engine.settings import EngineSettings  # noqa: E402
from policyscan.engine.warmup.compile_ahead import dry_run, shape_classes  # noqa: E402
from policyscan.engine.warmup.compile_procs import KERNEL_MODULES, Compilers  # noqa: E402


def import_seconds(modules: list[str], n: int) -> float:
    """Wall time of n processes importing the kernels' modules at once."""
    code = "import importlib, sys\nfor m in sys.argv[1:]: importlib.import_module(m)"
    t0 = time.perf_counter()
    procs = [subprocess.Popen([sys.executable, "-c", code, *modules]) for _ in range(n)]
    for p in procs:
        p.wait()
    return time.perf_counter() - t0

def timed_compile(variants: list, workers: int, settle: float) -> tuple[list[float], float]:
    """Each variant's compile seconds (as its worker answered) and the makespan, in the engine's workers
    (Compilers) started `settle` seconds before the first variant is sent."""
    with Compilers(workers, KERNEL_MODULES) as compilers:
        time.sleep(settle)
        t0 = time.perf_counter()
        errors = compilers.compile([(v.module, v.name, v.data) for v in variants])
        wall = time.perf_counter() - t0
        took = compilers.seconds
    failed = [(v.name, e) for v, e in zip(variants, errors) if e is not None]
    if failed:
        raise SystemExit(f"{len(failed)} variants failed, the first: {failed[0]}")
    return took, wall


def makespan(times: list[float], workers: int) -> float:
    """A queue's finish time when `workers` take the variants in this order."""
    free = [0.0] * workers
    for t in times:
        free[free.index(min(free))] += t
    return max(free)

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--workers", type=int, default=16)
    args = ap.parse_args()
    root, _ = prepare(args.dir, args.workload, "cuda")
    settings = EngineSettings(device="cuda", compile_ahead=False)
    engine = Engine(root / "model", load_policies([root / "bundles"]), settings)
    heads = [b.head for b in engine.builders]
    t0 = time.perf_counter()
    variants = dry_run(engine.decoder, heads, shape_classes(settings.batch_tokens, settings.cuda_graphs),
                        lambda v: None)
    print(f"dry run: {len(variants)} variants in {time.perf_counter() - t0:.2f} s", flush=True)
    modules = sorted({v.module for v in variants})
    many = import_seconds(modules, args.workers)
    print(f"import of {modules}: one process {import_seconds(modules, 1):.2f} s, {args.workers} at once "
          f"{many:.2f} s", flush=True)
    took, wall = timed_compile(variants, args.workers, settle=many + 1)
    print(f"\n{len(variants)} variants in {args.workers} workers started {many + 1:.1f} s before: makespan "
          f"{wall:.2f} s; compile seconds summed {sum(took):.1f} (contended)")
    print(f"queue model, {args.workers} workers: dry run's order {makespan(took, args.workers):.2f} s, longest first "
          f"{makespan(sorted(took, reverse=True), args.workers):.2f} s, slowest variant {max(took):.2f} s\n")
    print("| variant (kernel) | seconds | specialization (start) |\n|---|---|---|")
    by_name: dict[str, list[float]] = {}
    for v, t in zip(variants, took):
        by_name.setdefault(v.name, []).append(t)
    for i in sorted(range(len(variants)), key=lambda i: -took[i])[:12]:
        print(f"| {variants[i].name} | {took[i]:.2f} | {json.loads(variants[i].data).get('key', '')!s:.60} |")
    print("\n| kernel | variants | seconds summed | slowest |\n|---|---|---|---|")
    for name, ts in sorted(by_name.items(), key=lambda kv: -sum(kv[1])):
        print(f"| {name} | {len(ts)} | {sum(ts):.1f} | {max(ts):.2f} |")

if __name__ == "__main__":
    main()
