"""The compiling workers (engine/warmup/compile_procs.py) started as the command line begins, on a fresh machine.

A fresh machine's run compiles its kernels while its model loads (engine/warmup/compile_ahead.py), in workers forked
from one process that imports torch, Triton and the kernels first. Started by the engine, that process began importing
only after the command line's own import of the same modules, so its workers took their first variant seconds after the
dry run began handing them out, from its first batch on (docs/performance.md). Started here, before
the command line imports torch, it imports beside it, and the engine takes it over (compile_ahead.start_compilers). Only
where the run will compile on a GPU of this process: score or calibrate, not on the CPU, Ray or the worker path (each
worker starts its own), and a Triton cache that holds no policyscan variant yet; a warm machine starts nothing.

Only the standard library here: the command line imports this before torch."""
from __future__ import annotations

import atexit
import os
from pathlib import Path

from policyscan.engine.parallel.worker_start import gpus, option, reimported, will_run_workers, will_score
from policyscan.engine.warmup.compile_procs import Compilers

_STARTED: list[Compilers] = []  # the process's early compilers, until the engine takes them (take)


def prestart(argv: list[str]) -> None:
    """Start the compiling workers now when this command line will compile kernels on a fresh machine."""
    if reimported():
        return  # a worker re-importing the command line as its parent's main module
    if will_compile(argv, os.environ):
        _STARTED.append(Compilers.for_kernels())
        atexit.register(end)  # a run that ends before its engine starts (a bad argument, say) leaves none behind


def take() -> Compilers | None:
    """The early compilers, once: the engine's to use or end."""
    return _STARTED.pop() if _STARTED else None


def will_compile(argv: list[str], env: os._Environ | dict[str, str]) -> bool:
    """score or calibrate on a GPU of this process (not --from-scores: no model) and a Triton cache with no
    policyscan variant."""
    device = option(argv, "--device", "auto")
    return (will_score(argv, ("score", "calibrate")) and "--from-scores" not in argv
            and (device in ("auto", "cuda") or device.startswith("cuda:"))
            and not (argv[0] == "score" and will_run_workers(argv)) and gpus() > 0
            and not (triton_cache(env) / "policyscan_variants").exists())


def triton_cache(env: os._Environ | dict[str, str]) -> Path:
    """Triton's cache folder as triton.knobs.cache.dir has it, without importing Triton."""
    if env.get("TRITON_CACHE_DIR"):
        return Path(env["TRITON_CACHE_DIR"])
    return Path(env.get("TRITON_HOME") or os.path.expanduser("~/")) / ".triton" / "cache"


def end() -> None:
    """End the early compilers if the engine did not take them (a CPU run, compile-ahead off)."""
    while _STARTED:
        _STARTED.pop().kill()
