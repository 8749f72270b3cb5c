"""File helpers: sha256 of files (remembered per file identity, across runs) and work in a background thread."""
from __future__ import annotations

import hashlib
import os
import threading
import time
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


_SHA_CACHE: dict[str, str] = {}


def cache_dir() -> Path | None:
    """Where policyscan keeps what it may reuse across runs: $POLICYSCAN_CACHE_DIR, else ~/.cache/policyscan;
    None when there is no home to put it in."""
    try:
        return Path(os.environ.get("POLICYSCAN_CACHE_DIR") or Path.home() / ".cache" / "policyscan")
    except RuntimeError:
        return None


# A digest is remembered only for a file untouched this long before its hash finished: a rewrite within one
# timestamp tick (coarse clocks, some file systems' 1-2 s) would keep the identity it was hashed under (git's
# "racily clean" rule).
SETTLED_NS = 3_000_000_000


def _identity(st: os.stat_result, path: Path) -> str:
    return f"{path.resolve()}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\0{st.st_ino}\0{st.st_dev}"


def cached_sha256(path: Path, fresh: bool = False) -> str:
    """file_sha256, remembered per file identity (path, size, mtime, ctime, inode, device) in this process and
    on disk under cache_dir(): W1's 6.4 GB checkpoint took 5.8 s of an 18 s run to hash again each night. A
    changed file changes its ctime, which no user call can set back. fresh: read the file whatever is remembered
    (`verify`), and remember the result."""
    before = path.stat()
    key = hashlib.sha256(_identity(before, path).encode()).hexdigest()
    root = cache_dir()
    entry = root / "sha256" / key if root is not None else None
    if not fresh:
        if key in _SHA_CACHE:
            return _SHA_CACHE[key]
        try:
            text = entry.read_text() if entry is not None else ""
            if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
                _SHA_CACHE[key] = text
                return text
        except OSError:
            pass
    digest = file_sha256(path)
    after = path.stat()
    settled = time.time_ns() - max(after.st_mtime_ns, after.st_ctime_ns) > SETTLED_NS
    if _identity(after, path) != _identity(before, path) or not settled:
        return digest  # changed while read, or too recently to trust the identity: not remembered
    _SHA_CACHE[key] = digest
    if entry is not None:
        tmp = entry.with_name(f"{key}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:  # best effort: a read-only or full cache folder only costs the next run a re-read
            entry.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_text(digest)
            os.replace(tmp, entry)
        except OSError:
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
    return digest


def file_sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
