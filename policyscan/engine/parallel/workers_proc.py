"""Inside a worker process: load the Engine once, then score the units the parent sends, chunk by chunk, with the
single-process pipeline's own code; what it would write goes back to the parent as parts."""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from policyscan.engine.errors import InputError, PolicyscanError
from policyscan.engine.inputs.rows import PartialFileError
from policyscan.engine.outputs.accounting import Accounting, FileFailure, StrictStop
from policyscan.engine.outputs.run_output import hash_ids
from policyscan.engine.parallel.worker_start import apply_env
from policyscan.engine.policy.bundle import fingerprint, load_policies
from policyscan.engine.run.pipeline import prefetch, score_chunk, unit_items

if TYPE_CHECKING:  # torch: imported where the worker starts, so that the Ray driver can take Failed without it
    from policyscan.engine.run.runner import Engine

_END = object()  # a unit's last item


@dataclass(frozen=True)
class Scored:
    """A chunk as the pipeline scored it: its error rows, its output rows, its accounting, its ids' hashes."""

    errors: list[tuple]  # ErrorWriter.add's arguments
    writes: list[tuple]  # ScoreWriter.write's arguments
    acc: Accounting
    hashes: np.ndarray

    def __post_init__(self) -> None:
        if len(self.writes) > 1:
            raise ValueError(f"a chunk is written at once, got {len(self.writes)} writes")


@dataclass(frozen=True)
class Failed:
    """A file that could not be read, whole or from row `done` on (a FileFailure, which does not pickle)."""

    path: str
    message: str
    done: int
    total: int | None  # the rows its footer promises, when known

    def __post_init__(self) -> None:
        if self.done < 0 or (self.total is not None and self.total < self.done):
            raise ValueError(f"{self.path}: {self.done} rows read of {self.total}")

    def failure(self) -> FileFailure:
        error = InputError(self.message) if self.total is None else PartialFileError(self.message, self.done,
                                                                                      self.total)
        return FileFailure(Path(self.path), error, self.done)


@dataclass(frozen=True)
class Stopped:
    """--strict: the unit's first bad row, with the message the single-process path gives."""

    message: str


class Recorder:
    """Stands in for ScoreWriter and ErrorWriter: what the pipeline writes, kept for the parent to write."""

    def __init__(self) -> None:
        self.writes: list[tuple] = []
        self.errors: list[tuple] = []

    def write(self, *args) -> None:
        self.writes.append(args)

    def add(self, *args) -> None:
        self.errors.append(args)


def worker_main(conn: Connection, config, slot: int, env: dict[str, str]) -> None:
    apply_env(env)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the parent stops us
    # before CUDA starts (nothing so far touched it): a GPU worker sees its device as cuda:0, a CPU worker none
    os.environ["CUDA_VISIBLE_DEVICES"] = "" if config.devices[slot] == "cpu" else config.devices[slot]
    lock = threading.Lock()

    def send(msg: tuple) -> None:
        with lock:  # the main thread and the describing thread both send
            conn.send(msg)

    try:
        from policyscan.engine.run.runner import Engine  # the fork server imported it already (worker_start.PRELOAD)

        policies = load_policies(list(config.policies))
        engine = Engine(config.model_dir, policies, config.settings)
    except Exception as e:
        send(("fatal", str(e) if isinstance(e, PolicyscanError) else f"{type(e).__name__}: {e}"))
        return
    send(("ready", os.getpid(), [fingerprint(p) for p in policies]))
    threading.Thread(target=_describe, args=(engine, send), daemon=True, name="policyscan-describe").start()
    try:
        _serve(engine, conn, send)
    except (BrokenPipeError, EOFError):  # the parent is gone: nobody to tell
        sys.exit(1)
    except Exception as e:  # a CUDA error leaves the device unusable: end here, the parent hands our units on
        try:
            send(("crash", f"failed: {type(e).__name__}: {e}"))
        finally:
            sys.exit(1)


def _describe(engine: Engine, send) -> None:
    """The output's metadata as this worker would write it (waits for the model's hash, taken in the background)."""
    try:
        send(("describe", engine.describe(), engine.checkpoint.file_hashes()))
    except (BrokenPipeError, EOFError, OSError):
        return


def _serve(engine: Engine, conn: Connection, send) -> None:
    names = [p.name for p in engine.policies]
    items = prefetch(_read_units(engine, conn))  # the next chunk, and the next unit, read while one is scored
    stopped: int | None = None
    while True:
        t = time.perf_counter()
        item = next(items, None)
        waited = time.perf_counter() - t
        if item is None:
            return
        index, strict, it = item
        if it is _END:
            send(("done", index))
        elif index != stopped:
            part = _part(engine, names, it, strict, waited)
            stopped = index if isinstance(part, Stopped) else stopped
            send(("part", index, part))


def _read_units(engine: Engine, conn: Connection):
    """Each unit's encoded chunks, then _END; ends when the parent says stop (None) or is gone."""
    while True:
        try:
            msg = conn.recv()
        except EOFError:
            return
        if msg is None:
            return
        unit, _, spec, strict = msg  # (unit, attempt, spec, strict): the attempts are the parent's to count
        for it in unit_items(engine, unit, spec):
            yield unit.index, strict, it
        yield unit.index, strict, _END


def _part(engine: Engine, names: list[str], it, strict: bool, waited: float) -> Scored | Failed | Stopped:
    if isinstance(it, FileFailure):
        total = it.error.total if isinstance(it.error, PartialFileError) else None
        return Failed(str(it.path), str(it.error), it.done, total)
    rec = Recorder()
    acc = Accounting(above_threshold={n: 0 for n in names}, input_wait_seconds=waited)
    try:
        ids = score_chunk(engine, *it, rec, rec, acc, strict)
    except StrictStop as e:
        return Stopped(str(e))
    return Scored(rec.errors, rec.writes, acc, hash_ids(ids))
