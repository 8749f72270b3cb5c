"""Score files: sources -> prompts -> engine -> sinks, with row accounting that always balances."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from policyscan.engine.files import changed_since_hashed, input_file_sha256
from policyscan.engine.errors import InputError
from policyscan.engine.outputs.sinks import (ErrorWriter, ScoreWriter, commit_together, meta_path, read_metadata,
                                     remove_leftovers)
from policyscan.engine.inputs.sources import Chunk, PartialFileError, ReadSpec, read_chunks

if TYPE_CHECKING:  # torch: the `score --ray` driver writes outputs without it
    from policyscan.engine.run.runner import Engine


@dataclass(frozen=True)
class OutputSpec:
    fmt: str = "parquet"
    layout: str = "wide"
    raw: bool = False
    strict: bool = False
    flagged: bool = False     # flagged_<policy> = p >= the policy's threshold
    truncation: bool = False  # `truncated`: the prompt lost the conversation's oldest tokens

    def __post_init__(self) -> None:
        if self.fmt not in ("parquet", "jsonl"):
            raise InputError(f"--format must be parquet or jsonl, got {self.fmt!r}")
        if self.layout not in ("wide", "long"):
            raise InputError(f"--layout must be wide or long, got {self.layout!r}")


@dataclass
class Accounting:
    rows_in: int = 0
    rows_scored: int = 0
    rows_in_errors: int = 0
    files_in_errors: int = 0
    prompt_tokens: int = 0
    truncated_prompts: int = 0
    clipped_conversations: int = 0
    seconds: float = 0.0          # the whole scoring window, of which:
    input_wait_seconds: float = 0.0  # waiting for the reader: reading and tokenizing the GPU did not hide
    output_seconds: float = 0.0      # calibrating and writing
    duplicate_ids: int = 0  # scored rows whose id an earlier row of the same output already has
    above_threshold: dict[str, int] = field(default_factory=dict)

    def add(self, other: "Accounting") -> None:
        for k, v in asdict(other).items():
            if k == "above_threshold":
                for name, n in v.items():
                    self.above_threshold[name] = self.above_threshold.get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.rows_scored + self.rows_in_errors


class StrictStop(InputError):
    """--strict: the first row that cannot be scored ends the run."""


# Raised with every change that can move a score or a prompt's tokens, so that `-o DIR/` scores again what an
# earlier policyscan wrote (2: SentencePiece-style tokenizers encode the pieces after the prefix as they follow
# other text; the CPU path's LoRA shrink is a GEMM; 3: special-token strings in conversation text encode as text).
SCORING_REVISION = 3


def run_key(engine: Engine, spec: ReadSpec, out: OutputSpec, input_sha: str) -> str:
    """What an output depends on: input bytes, model, adapters and calibration, and every setting."""
    d = engine.describe()
    # threads change no bit of f (tests/test_cpu_threads.py): an archive scored with another --threads is done
    settings = {k: v for k, v in d["settings"].items() if k != "threads"}
    parts = {"input": input_sha, "model": d["model"]["sha256"], "policies": d["policies"],
             "settings": settings, "chat_template": d["chat_template"], "precision": d["precision"],
             "read": asdict(spec), "out": asdict(out),
             "version": d["policyscan_version"], "scoring_revision": SCORING_REVISION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def up_to_date(output: Path, key: str) -> bool:
    meta = read_metadata(output) if output.exists() else None
    return bool(meta) and meta.get("run_key") == key and meta.get("accounting", {}).get("balanced", False)


def score_inputs(engine: Engine, inputs: list[Path], output: Path, errors: Path, spec: ReadSpec, out: OutputSpec,
                 progress: Callable[[int, int], None] | None = None, keyed: bool = False,
                 input_sha256: list[str] | None = None) -> Accounting:
    """Score `inputs` into one output file (and one errors file); both appear whole or not at all.
    keyed: record the run key of a one-input output (run_key), what `-o DIR` compares to skip it next time;
    taken when the output is written, since it waits for the model's hash (hashed while the GPU works).
    input_sha256: the inputs' hashes when the caller already has them (each file is hashed once)."""
    shas, writer, err, acc = open_outputs(engine.policies, inputs, output, errors, out, keyed, input_sha256)
    id_hashes: list[np.ndarray] = []
    t0 = time.perf_counter()
    try:
        items = prefetch(_encoded(engine, inputs, spec))
        while True:
            t = time.perf_counter()
            item = next(items, None)
            acc.input_wait_seconds += time.perf_counter() - t
            if item is None:
                break
            if isinstance(item, FileFailure):
                file_failure(item, err, acc, out.strict)
                continue
            id_hashes.append(hash_ids(score_chunk(engine, *item, writer, err, acc, out.strict)))
            if progress:
                progress(len(item[0]), acc.prompt_tokens)
        acc.seconds = time.perf_counter() - t0
        commit_outputs(engine, engine.checkpoint.file_hashes(), id_hashes, inputs, shas, output, errors, spec, out,
                       keyed, writer, err, acc)
    except BaseException:
        writer.abort()
        err.abort()
        raise
    return acc


def open_outputs(policies, inputs: list[Path], output: Path, errors: Path, out: OutputSpec, keyed: bool,
                 input_sha256: list[str | None] | None) -> tuple[list, ScoreWriter, ErrorWriter, Accounting]:
    """A run's input hashes (taken before reading: what was scored is what is named; None for an input that is not
    a regular file or cannot be opened, which its reader lists), its writers and accounting; temp files of dead
    runs of these outputs removed."""
    if keyed and len(inputs) != 1:
        raise ValueError(f"a run key names one input's output, got {len(inputs)} inputs")
    shas = input_sha256 or [input_file_sha256(p) for p in inputs]
    names = [p.name for p in policies]
    remove_leftovers([output, errors, meta_path(output)])
    writer = ScoreWriter(output, out.fmt, out.layout, names, out.raw,
                         [p.threshold for p in policies] if out.flagged else None, out.truncation)
    return shas, writer, ErrorWriter(errors), Accounting(above_threshold={n: 0 for n in names})


def commit_outputs(scorer, model_files: dict, id_hashes: list[np.ndarray], inputs: list[Path], shas: list[str | None],
                   output: Path, errors: Path, spec: ReadSpec, out: OutputSpec, keyed: bool, writer: ScoreWriter,
                   err: ErrorWriter, acc: Accounting, **extra) -> None:
    """The metadata (scorer: an Engine, or a pool of them; both describe() the run), then the output, its
    metadata and its errors file renamed together. An input that changed since it was hashed is listed in the
    errors file and recorded without a hash (`changed_while_read`), and an output with an input without one has no
    run key: `-o DIR/` never takes it for up to date."""
    changed = [_changed_while_read(p, h, err, acc, out.strict) for p, h in zip(inputs, shas)]
    shas = [None if c else h for h, c in zip(shas, changed)]
    acc.duplicate_ids = _repeats(id_hashes)
    meta = {**scorer.describe(), "model_files": model_files, **extra,
            "inputs": [_input_record(p, h, output, c) for p, h, c in zip(inputs, shas, changed)],
            "read": asdict(spec), "output": asdict(out), "errors_file": str(errors) if err.count else None,
            "accounting": {**asdict(acc), "balanced": acc.balanced},
            "run_key": run_key(scorer, spec, out, shas[0]) if keyed and shas[0] is not None else None}
    moves, remove = err.finish()
    commit_together(writer.finish(meta) + moves, remove)


@dataclass(frozen=True)
class FileFailure:
    """A file that could not be read (whole, or from row `done` on): accounted by the consumer."""

    path: Path
    error: InputError
    done: int


def _encoded(engine: Engine, inputs: list[Path], spec: ReadSpec) -> Iterator[tuple[Chunk, list] | FileFailure]:
    """Chunks with their valid conversations tokenized (runs in the prefetch thread)."""
    for path in inputs:
        yield from encoded_chunks(engine, path, read_chunks(path, spec, engine.encoder.render))


def encoded_chunks(engine: Engine, path: Path, chunks: Iterator[Chunk]) -> Iterator[tuple[Chunk, list] | FileFailure]:
    """One file's (or unit's) chunks encoded as they are read; a read that fails ends them with its FileFailure,
    which counts the rows read before it."""
    done = 0
    try:
        for chunk in chunks:
            done += len(chunk)
            yield encode_chunk(engine, chunk)
    except InputError as e:
        yield FileFailure(path, e, done)


def encode_chunk(engine: Engine, chunk: Chunk) -> tuple[Chunk, list[np.ndarray]]:
    """A chunk's valid conversations tokenized, its texts dropped (chunks queue up without them)."""
    # No prompt uses more of a conversation than the largest budget; one token more keeps "was it cut" known.
    keep = max(b.budget for b in engine.builders) + 1
    valid = [i for i, t in enumerate(chunk.texts) if t is not None]
    errors, convs = list(chunk.errors), []
    for i, ids in zip(valid, engine.encoder.encode_batch([chunk.texts[i] for i in valid])):
        if ids:
            convs.append(np.asarray(ids[-keep:], dtype=np.int32))
        else:  # a tokenizer that normalizes a text away: an error row, not a crash of the run
            errors[i] = "the conversation encodes to no tokens"
    return dataclasses.replace(chunk, texts=[], errors=errors), convs


def _changed_while_read(path: Path, sha: str | None, err: ErrorWriter, acc: Accounting, strict: bool) -> bool:
    """Whether the hashed input `path` changed since its hash began (its reading is over), then listed in the errors
    file: the rows read from it are scored, but no hash names the bytes they came from."""
    if sha is None or (how := changed_since_hashed(path)) is None:
        return False
    file_failure(FileFailure(path, InputError(f"{path}: changed while it was read ({how}); the rows read were "
                                               "scored, but its hash is of the file before: score it again when it "
                                               "is complete"), 0), err, acc, strict)
    return True


def file_failure(ff: FileFailure, err: ErrorWriter, acc: Accounting, strict: bool) -> None:
    if strict:
        raise StrictStop(str(ff.error)) from ff.error
    acc.files_in_errors += 1
    total = ff.error.total if isinstance(ff.error, PartialFileError) else None
    lost = 0 if total is None else total - ff.done
    if lost:  # rows the Parquet footer promises but that could not be read: each one accounted
        acc.rows_in += lost
        acc.rows_in_errors += lost
        for r in range(ff.done, total):
            err.add(str(ff.path), r, None, None, str(ff.error))
    else:
        err.add(str(ff.path), None, None, None, str(ff.error))


def score_chunk(engine: Engine, chunk: Chunk, convs: list[np.ndarray], writer: ScoreWriter, err: ErrorWriter,
                 acc: Accounting, strict: bool) -> pa.Array:
    """Score one chunk's valid rows and write them; returns the ids written."""
    ok = np.array([e is None for e in chunk.errors], dtype=bool)
    acc.rows_in += len(chunk)
    acc.clipped_conversations += chunk.clipped
    for i in np.flatnonzero(~ok):
        row_error(chunk, int(i), chunk.errors[i], err, strict)
    acc.rows_in_errors += int((~ok).sum())
    f, tokens, truncated = engine.score_conversations(convs)
    t = time.perf_counter()
    idx = np.flatnonzero(ok)
    finite = np.isfinite(f).all(axis=1)
    for r in np.flatnonzero(~finite):  # never written as a number: NaN or Inf is no probability
        bad = ", ".join(f"{pol.name} {f[r, j]}" for j, pol in enumerate(engine.policies) if not np.isfinite(f[r, j]))
        row_error(chunk, int(idx[r]), f"f is not finite ({bad}): no probability can be given; the model's "
                   "weights or activations overflow on this conversation", err, strict)
    acc.rows_in_errors += int((~finite).sum())
    idx, f = idx[finite], f[finite]
    conv_len = np.array([len(c) for c, keep in zip(convs, finite) if keep], dtype=np.int64)
    cut = conv_len[:, None] > np.array([b.budget for b in engine.builders], dtype=np.int64)[None, :]
    p = np.stack([pol.calibrate_np(f[:, j]) for j, pol in enumerate(engine.policies)], axis=1) \
        if len(idx) else np.zeros((0, len(engine.policies)))
    ids = chunk.ids.take(idx)
    writer.write(ids, {k: v.take(idx) for k, v in chunk.keep.items()}, p, f.astype(np.float64), cut)
    acc.rows_scored += len(idx)
    acc.prompt_tokens += tokens
    acc.truncated_prompts += truncated
    for j, pol in enumerate(engine.policies):
        acc.above_threshold[pol.name] += int((p[:, j] >= pol.threshold).sum())
    acc.output_seconds += time.perf_counter() - t
    return ids


def row_error(chunk: Chunk, i: int, reason: str, err: ErrorWriter, strict: bool) -> None:
    line = chunk.lines[i] if chunk.lines else None
    if strict:
        where = f"line {line}" if line else f"row {chunk.first_row + i}"
        raise StrictStop(f"{chunk.path}, {where}: {reason} (--strict stops at the first bad row)")
    err.add(chunk.path, chunk.first_row + i, line, chunk.ids[i].as_py(), reason)


def hash_ids(ids: pa.Array) -> np.ndarray:
    """64 bits per id (its repr, so 1 and "1" differ): duplicates are counted in 8 bytes a row."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(repr(v).encode("utf-8", "backslashreplace"),
                                                       digest_size=8).digest(), "little")
                        for v in ids.to_pylist()), dtype=np.uint64, count=len(ids))


def _repeats(hashes: list[np.ndarray]) -> int:
    """Rows whose id an earlier row already has."""
    flat = np.concatenate(hashes) if hashes else np.zeros(0, dtype=np.uint64)
    return int(len(flat) - len(np.unique(flat)))


def _input_record(path: Path, sha: str | None, output: Path, changed: bool) -> dict:
    """An input as typed, absolute, and relative to the output's folder: `verify` finds it from anywhere, and
    after the output and its inputs moved together. sha None: no hash names what was read: the file changed while
    it was read (`changed`; rows were scored) or it could not be read (no rows were)."""
    full = Path(os.path.realpath(path))  # Path.resolve() raises on a link loop (an input found in a folder)
    return {"path": str(path), "abs_path": str(full), "rel_path": os.path.relpath(full, output.resolve().parent),
            "sha256": sha, "changed_while_read": changed}


def prefetch(it: Iterator, depth: int = 2) -> Iterator:
    """Run a generator in a thread, `depth` items ahead: reading and tokenizing overlap the GPU."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    end = object()

    def work() -> None:
        try:
            for item in it:
                while not stop.is_set():
                    try:
                        q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(end)
        except BaseException as e:  # re-raised in the consumer
            q.put(e)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    try:
        while (item := q.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
