"""File helpers: sha256 of files (cached per path, size and mtime) and work in a background thread."""
from __future__ import annotations

import hashlib
import threading
from concurrent.futures import Future
from pathlib import Path


def in_background(fn, name: str) -> Future:
    """fn() in a daemon thread (it never holds up the process's exit, say after an input error); the Future's
    result() waits for it and raises what it raised. For hashing: hashlib and file reads release the GIL."""
    fut: Future = Future()

    def run() -> None:
        try:
            fut.set_result(fn())
        except BaseException as e:  # re-raised by result() in the thread that asks
            fut.set_exception(e)

    threading.Thread(target=run, name=name, daemon=True).start()
    return fut


_SHA_CACHE: dict[tuple[str, int, int], str] = {}


def cached_sha256(path: Path) -> str:
    """file_sha256, remembered per (path, size, mtime) in this process: the metadata lists the model's file
    hashes after the fingerprint took them (seconds for a large checkpoint) without reading them again."""
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA_CACHE:
        _SHA_CACHE[key] = file_sha256(path)
    return _SHA_CACHE[key]


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
