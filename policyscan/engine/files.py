"""File helpers: what a path is before it is opened, sha256 of files (remembered per file identity, across runs;
an input's identity when it was hashed, so that a change while it is read is seen) and work in a background thread."""
from __future__ import annotations

import errno
import hashlib
import os
import stat
import threading
import time
from concurrent.futures import Future
from pathlib import Path
from typing import IO

from policyscan.engine.errors import InputError


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


MISSING = "missing (no such file or directory)"
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


def _mode_kind(mode: int) -> str:
    kind = next((name for test, name in _KINDS if test(mode)), "not a file of a known kind")
    return f"{kind}, not a regular file"


def not_regular(path: Path) -> str | None:
    """What `path` is when it is not a regular file (links followed), in words: "a FIFO, not a regular file", "a
    dangling symbolic link (to X)", "a symbolic link loop", MISSING; None for a regular file. Only its
    metadata is looked at: nothing is opened, so a FIFO or a device is never waited on or read."""
    try:
        st = os.stat(path)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return "a symbolic link loop"
        if e.errno == errno.ENOENT and os.path.islink(path):
            try:
                return f"a dangling symbolic link (to {os.readlink(path)})"
            except OSError:  # removed in between
                return "a dangling symbolic link"
        if e.errno in (errno.ENOENT, errno.ENOTDIR):
            return MISSING
        return f"not accessible ({e.strerror})"
    if stat.S_ISREG(st.st_mode):
        return None
    try:
        via = f" (through a symbolic link to {os.readlink(path)})" if os.path.islink(path) else ""
    except OSError:  # replaced in between
        via = ""
    return _mode_kind(st.st_mode) + via


def check_regular(path: Path) -> None:
    """InputError naming `path` and what it is, unless it is a regular file."""
    if (what := not_regular(path)) is not None:
        raise InputError(f"{path}: {_advice(what)}")


def _advice(what: str) -> str:
    """What `not_regular` found, with what to do."""
    if what.startswith(("a dangling", "a symbolic link loop")):
        return f"{what}: it names no file; fix or remove the link"
    if "not a regular file" in what:
        return f"{what}: policyscan reads regular files only"
    return what


def open_regular(path: Path, mode: str = "rb", **kwargs) -> IO:
    """`path` opened as open(path, mode, **kwargs) would, for reading, only if it is a regular file: checked before
    (nothing is opened that could block or have effects, as a FIFO or a device) and on the descriptor opened, so a
    file swapped in between is refused too. Otherwise an InputError names the file and what it is."""
    check_regular(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # a FIFO swapped in: no wait for a writer
    except OSError as e:
        raise InputError(f"{path}: cannot open ({e.strerror})") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{path}: {_advice(_mode_kind(st.st_mode))}")
        os.set_blocking(fd, True)
        return open(fd, mode, **kwargs)
    except BaseException:
        os.close(fd)
        raise


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
    on disk under cache_dir(): hashing a checkpoint of several GB again was a third of a nightly run
    (docs/performance.md). A changed file changes its ctime, which no user call can set back. fresh: read the file
    whatever is remembered (`verify`), and remember the result."""
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
    """The sha256 of a regular file (anything else is an InputError naming it); the file's identity before it
    was read is remembered for changed_since_hashed."""
    h = hashlib.sha256()
    with open_regular(path) as f:
        _HASHED[os.path.abspath(path)] = _stamp(os.fstat(f.fileno()))
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def input_file_sha256(path: Path) -> str | None:
    """An input's sha256, or None when it is not a regular file or cannot be opened: the reader lists it in the
    errors file with the reason, and no hash names bytes that were never read."""
    try:
        return file_sha256(path)
    except (InputError, OSError):
        return None


Stamp = tuple[int, int, int, int, int]  # device, inode, size, mtime and ctime in ns: a write moves the ctime
_HASHED: dict[str, Stamp] = {}  # absolute path -> its stamp when file_sha256 last began to read it


def _stamp(st: os.stat_result) -> Stamp:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def changed_since_hashed(path: Path) -> str | None:
    """How `path` changed since file_sha256 began to read it in this process (written to, replaced, removed), or
    None: unchanged, or never hashed here. Rows read from a file that changed are not the bytes its hash names."""
    before = _HASHED.get(os.path.abspath(path))
    if before is None:
        return None
    try:
        now = _stamp(os.stat(path))
    except OSError as e:
        return f"it can no longer be looked at ({e.strerror})"
    if now == before:
        return None
    if now[:2] != before[:2]:
        return "another file took its name"
    if now[2] != before[2]:
        return f"its size went from {before[2]} to {now[2]} bytes"
    return "it was written to"
