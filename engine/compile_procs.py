"""Compile Triton kernel variants in child processes, into Triton's disk cache (engine/compile_ahead.py).

Plain subprocesses (`python -m policyscan.engine.compile_procs MODULE...`), not a multiprocessing pool: they never
import the caller's __main__ (a library user's unguarded script would run again in every child), and a daemonic
process (a scoring worker, engine/workers.py) may start them, where it may not start a pool. Each child imports
the kernels' modules as it starts, so that a caller starting them before its model load has their import (torch
and Triton, most of a child's first 7.6-12.4 s on the H200 machine, bench/compile_times.py) done by the time
the variants are known; then it takes one variant at a time from its parent as a JSON line and answers "ok" or
the error, so the slowest variants do not wait behind each other."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import threading
from collections import deque


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity, which a container or taskset narrows), else all."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


class Compilers:
    """Up to `workers` child processes, started now, importing `modules`; compile() hands them variants, close()
    (or the end of a with block) ends them. Nothing raises: a child that cannot start or dies leaves its variants
    uncompiled, with the reason."""

    def __init__(self, workers: int, modules: tuple[str, ...] = ()):
        self.children: list[subprocess.Popen] = []
        self.error: str | None = None
        for _ in range(max(1, workers)):
            try:
                self.children.append(subprocess.Popen(
                    [sys.executable, "-m", "policyscan.engine.compile_procs", *modules], text=True,
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL))
            except OSError as e:  # an embedded interpreter whose sys.executable is no Python, or no processes left
                self.error = f"no child process: {e}"
                break

    def compile(self, variants: list[tuple[str, str, str]]) -> list[str | None]:
        """(module, kernel name, Triton's serialized specialization) each; per variant None when it compiled, else
        why not."""
        todo = deque(enumerate(variants))
        results: list[str | None] = [self.error or "not compiled: no child process took it"] * len(variants)
        lock = threading.Lock()

        def feed(child: subprocess.Popen) -> None:
            i = None
            try:
                while True:
                    with lock:
                        if not todo:
                            return
                        i, v = todo.popleft()
                    child.stdin.write(json.dumps(v) + "\n")
                    child.stdin.flush()
                    line = child.stdout.readline()
                    results[i] = None if line.strip() == "ok" else (line.strip() or "the child process died")
                    if not line:
                        return
            except (OSError, ValueError) as e:  # the child died: its variant stays uncompiled, the others go on
                if i is not None:
                    results[i] = f"the child process failed: {e}"

        threads = [threading.Thread(target=feed, args=(c,), name=f"policyscan-compile-{n}")
                   for n, c in enumerate(self.children[:len(variants)])]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return results

    def close(self) -> None:
        for child in self.children:
            try:
                child.stdin.close()  # the child's loop ends at end of input
            except OSError:
                pass
        for child in self.children:
            child.wait()
        self.children = []

    def keep(self, n: int) -> None:
        """End the children beyond the first n now (fewer variants than children: the rest would only import)."""
        for child in self.children[n:]:
            child.kill()
            child.wait()
        self.children = self.children[:n]

    def kill(self) -> None:
        """End the children now, their variants unfinished (their feeding threads see them die)."""
        for child in self.children:
            child.kill()
        self.close()

    def __enter__(self) -> "Compilers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _serve(modules: list[str]) -> None:
    """In a child: the modules imported, then a variant a line on stdin, "ok" or the error a line on stdout."""
    for module in modules:
        try:
            importlib.import_module(module)
        except Exception:  # noqa: BLE001  each variant importing it again reports the error
            pass
    for line in sys.stdin:
        module, name, data = json.loads(line)
        try:
            getattr(importlib.import_module(module), name).preload(data)
            answer = "ok"
        except Exception as e:  # noqa: BLE001  reported to the parent, which compiles it at launch instead
            answer = f"{type(e).__name__}: {e}".replace("\n", " ")[:500]
        sys.stdout.write(answer + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    _serve(sys.argv[1:])
