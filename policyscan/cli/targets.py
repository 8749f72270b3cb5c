"""Where `score` writes: one job (inputs -> output + errors file) per target, its format from the suffix, and the
checks that run before anything is scored (nothing policyscan did not write is overwritten).

A path `score` writes is either not there yet or a regular file; anything else there (a FIFO, a device such as
/dev/full, a socket, a directory, a dangling link, a link loop) is a usage error before it is opened. The look at a
regular file (is it policyscan's?) reads a Parquet footer, or lines of at most sinks.LINE_LIMIT bytes."""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import click

from policyscan.cli.common import check_writable_dir, refuse_overwrites
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.files import MISSING, not_regular
from policyscan.engine.outputs.run_output import Job
from policyscan.engine.outputs.sinks import is_errors_file, meta_path, read_metadata

SUFFIX_FORMATS = ((".parquet", "parquet"), (".jsonl", "jsonl"), (".jsonl.gz", "jsonl"))
# The longest line an errors file policyscan wrote is taken to have: its reasons name keys and values of a row,
# never a whole row; a longer line is not read further (a file of one endless line is no errors file).
OPTIONS = {"output": "-o", "errors file": "--errors", "metadata file": "-o"}  # the option a path comes from


def output_format(output: str | None, fmt: str | None, per_input: bool) -> str:
    """-o FILE's suffix sets the format; --format may only agree with it."""
    if output is None or per_input:
        return fmt or "parquet"
    by_suffix = next((f for suffix, f in SUFFIX_FORMATS if output.endswith(suffix)), None)
    if by_suffix is None:
        raise click.UsageError(f"-o {output}: end the name in {', '.join(s for s, _ in SUFFIX_FORMATS)} "
                               "(the suffix sets the format), or end it in / for a folder of outputs")
    if fmt and fmt != by_suffix:
        raise click.UsageError(f"--format {fmt} disagrees with -o {output}, a {by_suffix} name; drop --format "
                               "or rename the output")
    return by_suffix


def plan_jobs(named: list[tuple[Path, Path]], output: str | None, per_input: bool, fmt: str,
              errors_path: str | None) -> list[Job]:
    """The outputs to write: one for all inputs, or with -o DIR/ one per input, at its name below the folder or
    glob that found it (named_input_files), so an archive's folders are kept and its files need not be named apart.
    Nothing is made here: make_folders, after the checks."""
    files = [f for f, _ in named]
    if not per_input:
        target = Path(output) if output else Path(f"{_stem(files[0]) if len(files) == 1 else 'scores'}.scores.{fmt}")
        return [Job(files, target, _errors_for(target, errors_path))]
    out_dir = Path(output)
    targets = [out_dir / name.parent / f"{_stem(name)}.scores.{fmt}" for _, name in named]
    dup = sorted(str(t) for t, n in Counter(targets).items() if n > 1)
    if dup:
        raise PolicyscanError(f"inputs of the same name would share an output: {dup}; score them in separate runs "
                              "or into separate -o folders")
    return [Job([f], t, _errors_for(t, None)) for f, t in zip(files, targets)]


def make_folders(jobs: list[Job]) -> None:
    """-o DIR/'s folders, once every check has passed (check_jobs(..., folders_made_later=True)), so that a
    refused run leaves none behind."""
    for folder in dict.fromkeys(j.target.parent for j in jobs):
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise click.UsageError(f"cannot create the output folder {folder} ({e.strerror})") from e


def check_jobs(jobs: list[Job], protected: dict[Path, str], folders_made_later: bool = False) -> None:
    """Before anything is scored: each output can be written and destroys nothing policyscan did not write.
    folders_made_later (-o DIR/): an output's folder that is not there yet is made by make_folders, so the
    nearest folder that is there must take new folders."""
    writes: list[tuple[Path, str]] = []
    for job in jobs:
        writes += [(job.target, "output"), (job.errors, "errors file")]
        if job.target.name.endswith((".jsonl", ".jsonl.gz")):
            writes.append((meta_path(job.target), "metadata file"))
    for job in (j for j in jobs if j.target.name.endswith(".parquet")):
        try:  # Arrow cannot open a name whose bytes are not UTF-8 (one made from such an input's name)
            str(job.target).encode("utf-8")
        except UnicodeEncodeError:
            shown = str(job.target).encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            raise click.UsageError(f"output {shown} has a name that is not UTF-8, which Arrow cannot write a Parquet "
                                   "file under: rename the input it is named after, or choose another -o") from None
    for path, what in writes:  # first: nothing below opens, or resolves, a path that is not a file
        if (kind := not_regular(path)) not in (None, MISSING):
            raise click.UsageError(f"{what} {path} is {kind}; policyscan writes only new or regular files: "
                                   f"choose another {OPTIONS[what]}")
    refuse_overwrites(writes, _existing(protected))
    _refuse_broken_links(writes, protected)
    for job in jobs:
        check_writable_dir(_made_from(job.target.parent, folders_made_later), f"output {job.target}")
        check_writable_dir(_made_from(job.errors.parent, folders_made_later), f"errors file {job.errors}")
        if job.target.is_file() and read_metadata(job.target) is None:
            raise click.UsageError(f"output {job.target} exists and is not a policyscan output; "
                                   "remove it or choose another -o")
        if job.errors.exists() and not is_errors_file(job.errors):
            raise click.UsageError(f"errors file {job.errors} exists and is not a policyscan errors file; "
                                   "remove it or choose another --errors")
        mp = meta_path(job.target)
        if job.target.name.endswith((".jsonl", ".jsonl.gz")) and mp.exists() and not _is_metadata(mp):
            raise click.UsageError(f"metadata file {mp} exists and is not policyscan metadata; remove it or choose "
                                   "another -o")


def _is_metadata(path: Path) -> bool:
    """Whether the regular file `path` holds the metadata policyscan writes beside a JSONL output."""
    try:
        meta = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(meta, dict) and "policyscan_version" in meta and "accounting" in meta


def _made_from(folder: Path, made_later: bool) -> Path:
    """The folder a write needs now: `folder`, or where make_folders will start making it (the nearest path that is
    there, a folder or not: check_writable_dir refuses it if it is no folder)."""
    if not made_later:
        return folder
    while not folder.exists() and folder.parent != folder:
        folder = folder.parent
    return folder


def _names_a_file(path: Path) -> bool:
    try:
        path.stat()
    except OSError:
        return False
    return True


def _existing(protected: dict[Path, str]) -> dict[Path, str]:
    """The protected paths that name a file: refuse_overwrites compares them by real path and file identity."""
    return {p: what for p, what in protected.items() if _names_a_file(p)}


def _refuse_broken_links(writes: list[tuple[Path, str]], protected: dict[Path, str]) -> None:
    """A protected path that names no file (an input, found in a folder, that is a dangling link or a link loop)
    is still there: writing over it would destroy the link. Compared by its absolute path, and by where it points."""
    names: dict[str, tuple[Path, str]] = {}
    for p, what in protected.items():
        if not _names_a_file(p):
            names[os.path.abspath(p)] = (p, what)
            names[os.path.realpath(p)] = (p, what)  # a loop: realpath gives a path of the loop, no error
    for path, what in writes:
        if (hit := names.get(os.path.abspath(path)) or names.get(os.path.realpath(path))) is not None:
            raise click.UsageError(f"{what} {path} is {hit[1]} ({hit[0]}); writing it would destroy it: "
                                   "choose another path")


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".parquet", ".jsonl", ".ndjson", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _errors_for(target: Path, given: str | None) -> Path:
    return Path(given) if given else target.with_name(target.name + ".errors.jsonl")
