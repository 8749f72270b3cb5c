"""Compile Triton kernel variants in child processes, into Triton's disk cache (engine/compile_ahead.py).

Plain subprocesses (`python -m policyscan.engine.compile_procs`), not a multiprocessing pool: they never import
the caller's __main__ (a library user's unguarded script would run again in every child), and a daemonic
process (a scoring worker, engine/workers.py) may start them, where it may not start a pool. Each child takes
one variant at a time from its parent as a JSON line and answers "ok" or the error, so the slowest variants
do not wait behind each other."""
from __future__ import annotations

import importlib
import json
import subprocess
import sys
import threading
from collections import deque


def compile_variants(variants: list[tuple[str, str, str]], workers: int) -> list[str | None]:
    """(module, kernel name, Triton's serialized specialization) each, compiled in up to `workers` children;
    per variant None when it compiled, else why not."""
    todo = deque(enumerate(variants))
    results: list[str | None] = ["not compiled: no child process took it"] * len(variants)
    lock = threading.Lock()

    def feed() -> None:
        try:
            child = subprocess.Popen([sys.executable, "-m", "policyscan.engine.compile_procs"], text=True,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        except OSError as e:  # an embedded interpreter whose sys.executable is no Python, or no processes left
            with lock:
                for i, _ in todo:
                    results[i] = f"no child process: {e}"
            return
        try:
            while True:
                with lock:
                    if not todo:
                        break
                    i, v = todo.popleft()
                child.stdin.write(json.dumps(v) + "\n")
                child.stdin.flush()
                line = child.stdout.readline()
                results[i] = None if line.strip() == "ok" else (line.strip() or "the child process died")
                if not line:
                    break
        except OSError as e:  # the child died: its variant stays uncompiled, the other children go on
            results[i] = f"the child process failed: {e}"
        finally:
            try:
                child.stdin.close()
            except OSError:
                pass
            child.wait()

    threads = [threading.Thread(target=feed, name=f"policyscan-compile-{n}") for n in range(max(1, workers))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return results


def _serve() -> None:
    """In a child: a variant a line on stdin, "ok" or the error a line on stdout."""
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
    _serve()
