"""Command-line inputs -> the files to read: files, directories and globs, each real file once.

Directories and `**` globs follow directory links but enter each real directory once (a link loop
ends there), and never pick up policyscan's own outputs, so `score arch -o arch/scores/` run every
night reads only the logs. What a directory or a glob finds that is not a regular file (a FIFO, a device, a
socket, a dangling link, a link loop) is still an input: its reader lists it in the errors file with what it is,
and the run goes on. A path named on the command line that is no directory must be a regular file: anything
else is an InputError."""
from __future__ import annotations

import glob
import os
import sys
from collections.abc import Callable, Iterator
from fnmatch import fnmatchcase
from pathlib import Path

from policyscan.engine.errors import InputError
from policyscan.engine.files import not_regular

SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".ndjson", ".json")
DIR_SUFFIXES = (".parquet", ".jsonl", ".jsonl.gz", ".ndjson")  # what a directory contributes
# what `score` writes
OUTPUT_SUFFIXES = (".scores.parquet", ".scores.jsonl", ".scores.jsonl.gz", ".errors.jsonl", ".meta.json")


def is_own_output(path: Path) -> bool:
    """A scores, errors or metadata file that policyscan writes (by its name)."""
    return path.name.endswith(OUTPUT_SUFFIXES)


def expand_inputs(inputs: list[str], note: Callable[[str], None] | None = None) -> list[Path]:
    """Files, directories (their supported files, sorted) and globs -> files, in the order given, each real
    file once; `note` (default: stderr) hears of every file named again."""
    return [f for f, _ in named_inputs(inputs, note)]


def named_inputs(inputs: list[str], note: Callable[[str], None] | None = None) -> list[tuple[Path, Path]]:
    """expand_inputs' files, each with its name below what the command line named: its path inside a directory,
    or below a glob's fixed folders (`arch/*/x.parquet`: `day1/x.parquet`), or its file name. `-o DIR/` keeps
    these folders, so the same file name in two folders of an archive gets two outputs."""
    note = note or _stderr
    out: list[tuple[Path, Path]] = []
    seen: dict[tuple[int, int] | str, Path] = {}
    for item in inputs:
        for f, name in _expand(item):
            key = _identity(f)
            if key in seen:
                note(f"policyscan: {f} is the same file as {seen[key]}; it is read once")
                continue
            seen[key] = f
            out.append((f, name))
    return out


def _expand(item: str) -> list[tuple[Path, Path]]:
    p = Path(item)
    if p.is_dir():
        found = sorted(f for f in walk_files(p) if f.name.endswith(DIR_SUFFIXES) and not is_own_output(f))
        if not found:
            raise InputError(f"{p}: directory holds no {', '.join(DIR_SUFFIXES)} files")
        return [(f, f.relative_to(p)) for f in found]
    if os.path.lexists(p):  # a name that is there (a glob's characters in it are its own)
        if (what := not_regular(p)) is not None:
            raise InputError(f"{item}: {what}; name a regular file, a directory or a glob")
        return [(p, Path(p.name))]
    if any(c in item for c in "*?["):
        base = _fixed_folders(item)
        found = sorted(f for f in _glob(item, base) if not is_own_output(f))
        if not found:
            raise InputError(f"{item}: the pattern matches no files (policyscan's own outputs are never inputs)")
        return [(f, _below(f.relative_to(base), f)) for f in found]
    raise InputError(f"{item}: no such file or directory")


def _below(name: Path, f: Path) -> Path:
    """A glob's name for `f`, '..' resolved; one that climbs out of the glob's folders is the file name alone, so an
    output never lands outside its -o folder."""
    name = Path(os.path.normpath(name))
    return Path(f.name) if name.parts[:1] == ("..",) else name


def _fixed_folders(pattern: str) -> Path:
    """The folders of a glob before its first wildcard: where its matches are found."""
    parts = Path(pattern).parts
    fixed = next(i for i, s in enumerate(parts) if glob.has_magic(s))
    return Path(*parts[:fixed]) if fixed else Path(".")


def _glob(pattern: str, base: Path) -> Iterator[Path]:
    """Files matching `pattern`, all below `base`; `**` (any depth) walks like a directory, so link loops end."""
    parts = Path(pattern).parts
    if "**" not in parts:
        yield from (Path(f) for f in glob.glob(pattern) if not Path(f).is_dir())
        return
    pats = parts[len(base.parts):]
    if base.is_dir():
        yield from (f for f in walk_files(base) if _match(f.relative_to(base).parts, pats))


def _match(parts: tuple[str, ...], pats: tuple[str, ...]) -> bool:
    """glob's rules: `**` is any number of directories, and wildcards skip names that start with a dot."""
    if not pats:
        return not parts
    if pats[0] == "**":
        return any(_match(parts[i:], pats[1:]) for i in range(len(parts) + 1)
                   if not any(s.startswith(".") for s in parts[:i]))
    if not parts or (parts[0].startswith(".") and not pats[0].startswith(".")):
        return False
    return fnmatchcase(parts[0], pats[0]) and _match(parts[1:], pats[1:])


def walk_files(top: Path) -> Iterator[Path]:
    """Every entry under `top` that is not a directory (files, and what the readers refuse: FIFOs, devices,
    sockets, dangling links, link loops), through directory links, entering each real directory once: real
    directories first, so a file is named by its own path where it has one inside `top`."""
    entered: set[tuple[int, int]] = set()
    dirs, links = [top], []
    while dirs or links:
        d = dirs.pop() if dirs else links.pop()
        key = _identity(d)
        if key in entered:
            continue
        entered.add(key)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name, reverse=True)
        except OSError as e:
            raise InputError(f"{d}: cannot list this directory ({e.strerror}); fix its permissions or leave it "
                             "out") from e
        for e in entries:
            if _is_dir(e):
                (links if e.is_symlink() else dirs).append(Path(e.path))
            else:
                yield Path(e.path)


def _is_dir(e: os.DirEntry) -> bool:
    """Whether an entry is a directory, through links; a link loop (which DirEntry raises for) is none."""
    try:
        return e.is_dir()
    except OSError:
        return False


def _identity(p: Path) -> tuple[int, int] | str:
    """The real file a path names; a link that names none (dangling, a loop) is itself: its absolute path."""
    try:
        st = os.stat(p)
    except OSError:
        return os.path.abspath(p)
    return st.st_dev, st.st_ino


def _stderr(message: str) -> None:
    print(message, file=sys.stderr)
