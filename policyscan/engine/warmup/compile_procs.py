"""Compile Triton kernel variants in child processes, into Triton's disk cache (engine/warmup/compile_ahead.py).

One plain subprocess (`python -m policyscan.engine.warmup.compile_procs`), not a multiprocessing pool: it never imports
the caller's __main__ (a library user's unguarded script would run again), and a daemonic process (a scoring worker,
engine/parallel/workers.py) may start it, where it may not start a pool. It imports the kernels' modules once and then
forks the compiling workers, which share that import: a fork is nearly free, while children each importing torch and
Triton themselves took many seconds beside the model load (docs/performance.md). Nothing in it touches CUDA
before the fork (the kernels' modules do not at import), so each worker may. A worker takes one variant at a time from
the caller as a JSON line on its own pipe and answers with a JSON string, "ok" or the error, so the slowest variants do
not wait behind each other. POSIX only (fork), as Triton's GPU path is."""
from __future__ import annotations

import importlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable

KERNEL_MODULES = ("policyscan.kernels.triton_ops",)  # what the compiling process imports ahead: every kernel's module
MAX_WORKERS = 16  # compiling workers at most (and no more than the CPUs)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset narrows), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Worker:
    """The caller's end of one compiling worker: a pipe each way."""

    def __init__(self, to_worker: int, from_worker: int):
        self.stdin = os.fdopen(to_worker, "w", encoding="utf-8")
        self.stdout = os.fdopen(from_worker, "r", encoding="utf-8")

    def close(self) -> None:
        for f in (self.stdin, self.stdout):
            try:
                f.close()  # the worker's loop ends at end of input
            except OSError:
                pass


class Compilers:
    """Up to `workers` compiling workers, started now in one process importing `modules`; compile() hands them
    variants, close() (or the end of a with block) ends them. Nothing raises: workers that cannot start or die
    leave their variants uncompiled, with the reason. `seconds`: each variant's compile as its worker answered."""

    @classmethod
    def for_kernels(cls) -> "Compilers":
        """The kernels' pool: a worker per usable CPU, MAX_WORKERS at most, importing KERNEL_MODULES."""
        return cls(min(MAX_WORKERS, usable_cpus()), KERNEL_MODULES)

    def __init__(self, workers: int, modules: tuple[str, ...] = ()):
        self.workers: list[Worker] = []
        self.error: str | None = None
        self.process: subprocess.Popen | None = None
        self.seconds: list[float] = []
        ends, theirs = [], []
        try:
            for _ in range(max(1, workers)):
                r0, w0 = os.pipe()  # caller -> worker
                ends.append([w0])
                theirs.append(r0)
                r1, w1 = os.pipe()  # worker -> caller
                ends[-1].append(r1)
                theirs.append(w1)
            # its own process group: kill() ends the workers it forked with it, Ctrl-C in a terminal reaches
            # the caller only, which ends them
            self.process = subprocess.Popen(
                [sys.executable, "-m", "policyscan.engine.warmup.compile_procs", ",".join(map(str, theirs)), *modules],
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                pass_fds=theirs, start_new_session=True)
            self.workers = [Worker(w, r) for w, r in ends]
        except OSError as e:  # an embedded interpreter whose sys.executable is no Python, or no processes left
            self.error = f"no child process: {e}"
            for fd in [fd for pair in ends for fd in pair]:
                os.close(fd)
        finally:
            for fd in theirs:
                os.close(fd)

    def compile(self, variants: Iterable[tuple[str, str, str]]) -> list[str | None]:
        """(module, kernel name, Triton's serialized specialization) each, handed out in the order `variants`
        gives them: it may be a generator that blocks until the next is known (compile_ahead's dry run streams
        them). Per variant, in that order: None when it compiled, else why not."""
        source, again = iter(variants), deque()  # again: handed to a worker that had gone, for another
        results: list[str | None] = []
        self.seconds = []
        lock = threading.Lock()

        def take() -> tuple[int, tuple[str, str, str]] | None:
            with lock:  # the source may block: the other workers wait here, as they would for work anyway
                if again:
                    return again.popleft()
                v = next(source, None)
                if v is None:
                    return None
                results.append(self.error or "not compiled: no child process took it")
                self.seconds.append(0.0)
                return len(results) - 1, v

        def feed(worker: Worker) -> None:
            while (item := take()) is not None:
                i, v = item
                t = time.perf_counter()
                try:
                    worker.stdin.write(json.dumps(v) + "\n")
                    worker.stdin.flush()
                except (OSError, ValueError):  # the worker had gone before it got this variant: another takes it
                    with lock:
                        again.appendleft(item)
                    return
                try:
                    line = worker.stdout.readline()
                except (OSError, ValueError) as e:
                    results[i] = f"the child process failed: {e}"
                    return
                if not line:  # it died on this variant: not handed out again (it would end the next worker too)
                    results[i] = "the child process died"
                    return
                answer = json.loads(line)
                results[i] = None if answer == "ok" else answer
                self.seconds[i] = time.perf_counter() - t

        threads = [threading.Thread(target=feed, args=(w,), name=f"policyscan-compile-{n}")
                   for n, w in enumerate(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        while take() is not None:  # no worker left (or none started): the rest are reported, not compiled
            pass
        return results

    def close(self) -> None:
        """End the workers once their variant at hand is done, and wait for them."""
        for worker in self.workers:
            worker.close()
        self.workers = []
        if self.process is not None:
            self.process.wait()

    def kill(self) -> None:
        """End every worker now, their variants unfinished (their feeding threads see them die)."""
        if self.process is not None and self.process.returncode is None:  # not reaped: its group is still its own
            try:
                os.killpg(self.process.pid, signal.SIGKILL)
            except OSError:  # ended already
                pass
        self.close()

    def __enter__(self) -> "Compilers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(to_worker: int, from_worker: int) -> None:
    """In a worker: a variant a line in, "ok" or the error a line out, until the caller closes its end."""
    with os.fdopen(to_worker, "r", encoding="utf-8") as lines, \
            os.fdopen(from_worker, "w", encoding="utf-8") as answers:
        for line in lines:
            module, name, data = json.loads(line)
            try:
                getattr(importlib.import_module(module), name).preload(data)
                answer = "ok"
            except Exception as e:  # noqa: BLE001  reported to the caller, which compiles it at launch instead
                answer = f"{type(e).__name__}: {e}"[:500]
            answers.write(json.dumps(answer) + "\n")  # one line whatever the message holds
            answers.flush()


def _main(fds: list[int], modules: list[str]) -> None:
    """The modules imported, then a worker forked per pipe pair; each keeps its own pair and closes the rest, so
    that a worker that dies is seen at once by the caller."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001  each variant importing it again reports the error
            pass
    pairs = list(zip(fds[::2], fds[1::2]))
    # The caller's model load comes first: beside the workers at the same priority it took several times as long
    # (docs/performance.md). The import above ran at the caller's priority: the workers must be ready when the dry
    # run ends.
    os.nice(10)
    for pair in pairs:
        if os.fork() == 0:
            for fd in fds:
                if fd not in pair:
                    os.close(fd)
            try:
                _serve(*pair)
            finally:
                os._exit(0)
    for fd in fds:
        os.close(fd)
    for _ in pairs:
        os.wait()


if __name__ == "__main__":
    _main([int(fd) for fd in sys.argv[1].split(",")], sys.argv[2:])
