"""One output of a run, from open to commit: its inputs' hashes (taken before they are read), its writers, the
hashes of the ids it wrote, and the metadata that names everything it depends on. Every executor (the Engine in
this process, a WorkerPool, a Ray run) writes through it and reports itself as a Scorer."""
from __future__ import annotations

import datetime
import gzip
import hashlib
import json
import os
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.files import changed_since_hashed, input_file_sha256
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.outputs.accounting import Accounting, FileFailure, OutputSpec, file_failure
from policyscan.engine.outputs.sinks import (
    ErrorWriter,
    ScoreWriter,
    commit_together,
    meta_path,
    read_metadata,
    remove_leftovers,
)


class Scorer(Protocol):
    """What an executor reports for the outputs' metadata and run keys."""

    def describe(self) -> dict:
        """Everything that decides the scores: model, adapters, calibration, settings, precision, versions."""

    def file_hashes(self) -> dict:
        """The model's files and their sha256."""


@dataclass(frozen=True)
class Job:
    """Inputs scored into one output and its errors file."""

    files: list[Path]
    target: Path
    errors: Path

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError("a job needs at least one input")


# Raised with every change that can move a score or a prompt's tokens, or which rows are scored, so that `-o DIR/`
# scores again what an earlier policyscan wrote (2: SentencePiece-style tokenizers encode the pieces after the
# prefix as they follow other text; the CPU path's LoRA shrink is a GEMM; 3: special-token strings in conversation
# text encode as text; 4: a prompt is cut at the model's max_position_embeddings when --max-length is more; 5: null
# and ill-typed ids, JSON naming a key twice and damaged gzip data are errors, not scored rows; strings nested in a
# message encode as text; 6: sequences of 2048 keys or more take a larger attention tile on the GPU, whose key block
# sums the softmax in another order; a chat template step that makes a special-token string of content fails the row;
# tojson renders as transformers' chat templates render it, without HTML escapes and with keys in their order; a
# message's null fields are left out and its reasoning is under reasoning_content and thinking, tools and documents
# are none, as transformers passes them; content may be a list of text parts, or null beside tool calls).
SCORING_REVISION = 6


def run_key(scorer: Scorer, spec: ReadSpec, out: OutputSpec, input_sha: str) -> str:
    """What an output depends on: input bytes, model, adapters and calibration, and every setting."""
    d = scorer.describe()
    # threads change no bit of f (tests/test_cpu_threads.py): an archive scored with another --threads is done
    settings = {k: v for k, v in d["settings"].items() if k != "threads"}
    parts = {"input": input_sha, "model": d["model"]["sha256"], "policies": d["policies"],
             "settings": settings, "chat_template": d["chat_template"], "precision": d["precision"],
             "read": asdict(spec), "out": asdict(out),
             "version": d["policyscan_version"], "scoring_revision": SCORING_REVISION}
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def up_to_date(output: Path, key: str) -> bool:
    """The output of this run key, balanced, and still holding every row its metadata records (an output cut or
    padded since it was written is scored again)."""
    meta = read_metadata(output) if output.exists() else None
    return (bool(meta) and meta.get("run_key") == key and meta.get("accounting", {}).get("balanced", False)
            and stored_rows(output) == recorded_rows(meta))


def stored_rows(out: Path) -> int | None:
    """How many rows a finished output holds (its Parquet footer, or the lines of a JSONL file), None if it cannot
    be read."""
    try:
        if out.name.endswith(".parquet"):
            return pq.ParquetFile(out).metadata.num_rows
        with (gzip.open(out, "rb") if out.name.endswith(".gz") else open(out, "rb")) as fh:
            return sum(1 for line in fh if line.strip())
    except (OSError, EOFError, zlib.error, pa.ArrowException):
        return None


def recorded_rows(meta: dict) -> int | None:
    """How many rows the metadata says the output holds: one a scored conversation, or one a conversation and
    policy in the long layout (None for metadata without accounting)."""
    scored = (meta.get("accounting") or {}).get("rows_scored")
    if not isinstance(scored, int):
        return None
    long = (meta.get("output") or {}).get("layout") == "long"
    return scored * (len(meta.get("policies") or ()) if long else 1)


class RunOutput:
    """One job's output being written. keyed: record the run key of a one-input output (run_key), what `-o DIR/`
    compares to skip it next time. input_sha256: the inputs' hashes when the caller already has them."""

    def __init__(self, policies: list, job: Job, spec: ReadSpec, out: OutputSpec, keyed: bool = False,
                 input_sha256: list[str | None] | None = None):
        if keyed and len(job.files) != 1:
            raise ValueError(f"a run key names one input's output, got {len(job.files)} inputs")
        self.job, self.spec, self.out, self.keyed = job, spec, out, keyed
        # taken before reading: what was scored is what is named (None: not a regular file, or unreadable)
        self.shas = input_sha256 or [input_file_sha256(p) for p in job.files]
        names = [p.name for p in policies]
        remove_leftovers([job.target, job.errors, meta_path(job.target)])
        self.writer = ScoreWriter(job.target, out.fmt, out.layout, names, out.raw,
                                  [p.threshold for p in policies] if out.flagged else None, out.truncation)
        self.err = ErrorWriter(job.errors)
        self.acc = Accounting(above_threshold={n: 0 for n in names})
        self.id_hashes: list[np.ndarray] = []
        self.started = time.perf_counter()

    def wrote(self, ids: pa.Array) -> None:
        """The ids of rows just written, for the count of duplicate ids."""
        self.id_hashes.append(hash_ids(ids))

    def commit(self, scorer: Scorer, **extra) -> Accounting:
        """The metadata, then the output, its metadata and its errors file renamed together. An input that changed
        since it was hashed is listed in the errors file and recorded without a hash (`changed_while_read`), and an
        output with an input without one has no run key: `-o DIR/` never takes it for up to date."""
        job, acc = self.job, self.acc
        acc.seconds = time.perf_counter() - self.started
        changed = [_changed_while_read(p, h, self.err, acc, self.out.strict) for p, h in zip(job.files, self.shas)]
        shas = [None if c else h for h, c in zip(self.shas, changed)]
        acc.duplicate_ids = _repeats(self.id_hashes)
        meta = {**scorer.describe(), "model_files": scorer.file_hashes(), **extra,
                "inputs": [_input_record(p, h, job.target, c) for p, h, c in zip(job.files, shas, changed)],
                "read": asdict(self.spec), "output": asdict(self.out),
                "errors_file": str(job.errors) if self.err.count else None,
                "accounting": {**asdict(acc), "balanced": acc.balanced},
                "written_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                "run_key": run_key(scorer, self.spec, self.out, shas[0]) if self.keyed and shas[0] is not None
                else None}
        moves, remove = self.err.finish()
        commit_together(self.writer.finish(meta) + moves, remove)
        return acc

    def abort(self) -> None:
        """Leave nothing behind: the temporary files go, the old outputs stay."""
        try:
            self.writer.abort()
        finally:
            self.err.abort()


def _changed_while_read(path: Path, sha: str | None, err: ErrorWriter, acc: Accounting, strict: bool) -> bool:
    """Whether the hashed input `path` changed since its hash began (its reading is over), then listed in the errors
    file: the rows read from it are scored, but no hash names the bytes they came from."""
    if sha is None or (how := changed_since_hashed(path)) is None:
        return False
    file_failure(FileFailure(path, InputError(f"{path}: changed while it was read ({how}); the rows read were "
                                               "scored, but its hash is of the file before: score it again when it "
                                               "is complete"), 0), err, acc, strict)
    return True


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


