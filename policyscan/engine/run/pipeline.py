"""Score files: sources -> prompts -> engine -> outputs, with row accounting that always balances."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.sources import Chunk, ReadSpec, read_chunks
from policyscan.engine.inputs.units import Unit, unit_chunks
from policyscan.engine.outputs.accounting import Accounting, FileFailure, OutputSpec, file_failure, row_error
from policyscan.engine.outputs.run_output import Job, RunOutput
from policyscan.engine.outputs.sinks import ErrorWriter, ScoreWriter

if TYPE_CHECKING:  # torch: the `score --ray` driver writes outputs without it
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.text.prompts import PolicyPrompts

def score_inputs(engine: Engine, inputs: list[Path], output: Path, errors: Path, spec: ReadSpec, out: OutputSpec,
                 progress: Callable[[int, int], None] | None = None, keyed: bool = False,
                 input_sha256: list[str] | None = None) -> Accounting:
    """Score `inputs` into one output file (and one errors file); both appear whole or not at all.
    keyed: record the run key of a one-input output (run_output.run_key), what `-o DIR` compares to skip it next
    time; taken when the output is written, since it waits for the model's hash (hashed while the GPU works).
    input_sha256: the inputs' hashes when the caller already has them (each file is hashed once)."""
    run = RunOutput(engine.policies, Job(inputs, output, errors), spec, out, keyed, input_sha256)
    acc = run.acc
    try:
        items = prefetch(encoded_inputs(engine, inputs, spec))
        while True:
            t = time.perf_counter()
            item = next(items, None)
            acc.input_wait_seconds += time.perf_counter() - t
            if item is None:
                break
            if isinstance(item, FileFailure):
                file_failure(item, run.err, acc, out.strict)
                continue
            run.wrote(score_chunk(engine, *item, run.writer, run.err, acc, out.strict))
            if progress:
                progress(len(item[0]), acc.prompt_tokens)
        return run.commit(engine)
    except BaseException:
        run.abort()
        raise


def encoded_inputs(engine: Engine, inputs: list[Path], spec: ReadSpec) -> Iterator[tuple[Chunk, list] | FileFailure]:
    """Chunks with their valid conversations tokenized (runs in the prefetch thread)."""
    for path in inputs:
        yield from encoded_chunks(engine, path, read_chunks(path, spec, engine.encoder.render))


def unit_items(engine: Engine, unit: Unit, spec: ReadSpec) -> Iterator[tuple[Chunk, list] | FileFailure]:
    """A unit's chunks with their conversations encoded, or the failure of its file (as encoded_inputs)."""
    return encoded_chunks(engine, unit.path, unit_chunks(unit, spec, engine.encoder.render))


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


def encode_chunk(engine: Engine | PolicyPrompts, chunk: Chunk) -> tuple[Chunk, list[np.ndarray]]:
    """A chunk's valid conversations tokenized, its texts dropped (chunks queue up without them); `engine` is
    anything holding the encoder and the policies' prompt builders."""
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
