"""How worker processes start (engine/parallel/workers.py): forked from a fork server that imported the engine once.

A spawned worker imports torch and the engine itself, after the parent has done the same: a one-GPU worker run took
far longer than the same run in-process, most of it that second import and the model load after it
(docs/performance.md). A fork server started when the command line begins imports the engine while the parent does,
and each worker is forked from it ready to load the model. The server never touches CUDA, so a forked worker starts
clean as a spawned one; it takes the parent's environment at its start (apply_env), not the server's, though
what libraries read once at import (OMP_NUM_THREADS, say) keeps the values from when the server started: the
command line changes none in between, but a long-lived library process that does keeps the server's.

Only the standard library here: the command line imports this before torch."""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from pathlib import Path

PRELOAD = ["policyscan.engine.parallel.workers_proc", "policyscan.engine.run.runner"]

NVIDIA_GPUS = Path("/proc/driver/nvidia/gpus")  # the driver's list of GPUs (Linux)


def context():
    """The start method for workers: the fork server on Linux, else spawn (forking after torch and Accelerate or
    libomp are loaded is unsafe on macOS). Setting the server's preload list is process-wide: a host application
    that runs its own fork server shares it."""
    if sys.platform.startswith("linux") and "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def prestart(argv: list[str]) -> None:
    """Start the fork server now, in parallel with this process's own imports, when the command line will run
    workers (score with --workers, --devices, or on a host with several GPUs)."""
    if reimported():
        return  # a worker re-importing the command line as its parent's main module: it starts no server
    if will_run_workers(argv) and context().get_start_method() == "forkserver":
        from multiprocessing import forkserver

        try:
            forkserver.ensure_running()
        except Exception:  # noqa: BLE001  only a speed-up: the pool starts the server when it needs it
            pass


def apply_env(env: dict[str, str]) -> None:
    """In a worker: the parent's environment as it was when the worker started (a fork server's is older)."""
    for key in set(os.environ) - set(env):
        del os.environ[key]
    os.environ.update(env)


def reimported() -> bool:
    """This process is a worker re-importing the command line as its parent's main module."""
    return bool(getattr(mp.current_process(), "_inheriting", False))


def will_score(argv: list[str], commands: tuple[str, ...]) -> bool:
    """The command line runs one of `commands` here (not --help, not on a Ray cluster)."""
    return bool(argv) and argv[0] in commands and not any(
        a in ("-h", "--help", "--ray") or a.startswith("--ray-address") for a in argv)


def option(argv: list[str], name: str, default: str | None = None) -> str | None:
    """The value the command line gives option `name` (`--name V` or `--name=V`; the last one counts)."""
    value = default
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


def will_run_workers(argv: list[str]) -> bool:
    if not will_score(argv, ("score",)):
        return False
    if any(a.startswith("--devices") for a in argv):
        return True
    workers = option(argv, "--workers")
    if workers is not None and workers.isdigit() and int(workers) > 1:
        return True
    return option(argv, "--device", "auto") in ("auto", "cuda") and gpus() > 1


def gpus() -> int:
    """GPUs this process may see, without importing torch: none without an NVIDIA driver (a CUDA_VISIBLE_DEVICES
    alone proves no GPU), else CUDA_VISIBLE_DEVICES's count, else the driver's list."""
    if not (sys.platform.startswith("linux") and NVIDIA_GPUS.is_dir()):
        return 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip()])
    return sum(1 for _ in NVIDIA_GPUS.iterdir())
