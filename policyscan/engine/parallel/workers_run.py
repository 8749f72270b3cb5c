"""score_inputs on a WorkerPool: the same output, errors file and row accounting as the single-process path,
bit for bit, with the work of every device of the host.

Units go out from one queue, each to a worker with room (DEPTH), only within a window of units past the first
one not yet written, so finished units wait in a bounded reorder buffer; they are written strictly in order. A
worker that dies gives its units back: each is then scored alone, and one that kills a worker again is written
as error rows with the reason."""
from __future__ import annotations

import bisect
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.inputs.units import UNIT_BYTES, UNIT_ROWS, LineRange, Unit, plan_units, range_lines
from policyscan.engine.outputs.accounting import Accounting, FileFailure, OutputSpec, StrictStop, file_failure
from policyscan.engine.outputs.run_output import Job, RunOutput
from policyscan.engine.parallel.workers import DEPTH, Event, Worker, WorkerPool
from policyscan.engine.parallel.workers_proc import Failed, Scored, Stopped


@dataclass(frozen=True)
class Poisoned:
    """A unit that was in flight on two workers that died, the second time alone: its rows are not scored."""

    why: str

    def __post_init__(self) -> None:
        if not self.why:
            raise ValueError("a unit given up on needs a reason")


@dataclass
class _Slot:
    unit: Unit
    parts: list = field(default_factory=list)
    done: bool = False
    alone: bool = False  # in flight when a worker died: scored alone from now on, so a second death is its own
    attempt: int = 0


class _Sink:
    """One output's units written in order through its RunOutput, as score_inputs writes chunks."""

    def __init__(self, run: RunOutput, progress: Callable[[int, int], None] | None):
        self.run, self.progress = run, progress
        self.writer, self.err, self.acc, self.strict = run.writer, run.err, run.acc, run.out.strict

    def write(self, slot: _Slot) -> None:
        for part in slot.parts:
            if isinstance(part, Scored):
                self._scored(part)
            elif isinstance(part, Failed):
                file_failure(part.failure(), self.err, self.acc, self.strict)
            elif isinstance(part, Stopped):
                raise StrictStop(part.message)
            else:
                self._poisoned(slot.unit, part.why)

    def _scored(self, part: Scored) -> None:
        t = time.perf_counter()
        for e in part.errors:
            self.err.add(*e)
        for w in part.writes:
            self.writer.write(*w)
        self.run.id_hashes.append(part.hashes)
        self.acc.add(part.acc)
        self.acc.output_seconds += time.perf_counter() - t
        if self.progress:
            self.progress(part.acc.rows_in, self.acc.prompt_tokens)

    def _poisoned(self, unit: Unit, why: str) -> None:
        reason = f"a worker process died on these rows twice ({why}); they were not scored"
        if unit.part is None:  # a whole file: its rows are not known, the file is listed as unreadable files are
            file_failure(FileFailure(unit.path, InputError(f"{unit.path}: {reason}"), 0), self.err, self.acc,
                          self.strict)
            return
        rows = unit.part.file_rows
        if self.strict:
            raise StrictStop(f"{unit.path}, rows {rows.start} to {rows.stop - 1}: {reason}")
        lines = range_lines(unit.path, unit.part) if isinstance(unit.part, LineRange) else [None] * len(rows)
        for r, line in zip(rows, lines):
            self.err.add(str(unit.path), r, line, None, reason)
        self.acc.rows_in += len(rows)
        self.acc.rows_in_errors += len(rows)


class _Schedule:
    """Hands out units, takes their parts, gives a dead worker's units to the others, writes units in order."""

    def __init__(self, pool: WorkerPool, units: list[Unit], spec: ReadSpec, strict: bool, window: int):
        self.pool, self.spec, self.strict, self.window = pool, spec, strict, window
        self.slots = {u.index: _Slot(u) for u in units}
        self.pending = [u.index for u in units]  # sorted: units go out, and go back, in input order
        self.total, self.next = len(units), 0

    def run(self, sink: _Sink) -> None:
        while self.next < self.total:
            for w in self.pool.ready_workers():
                self._fill(w)
            for event in self.pool.events():
                self._take(event)
            while self.next < self.total and self.slots[self.next].done:
                sink.write(self.slots.pop(self.next))
                self.next += 1

    def _fill(self, w: Worker) -> None:
        while (index := self._pick(w)) is not None:
            self.pending.remove(index)
            slot = self.slots[index]
            self.pool.send(w, slot.unit, slot.attempt, self.spec, self.strict)

    def _pick(self, w: Worker) -> int | None:
        """The first waiting unit within the window that `w` may take now."""
        if len(w.units) >= DEPTH or any(self.slots[i].alone for i in w.units):
            return None
        for index in self.pending:
            if index >= self.next + self.window:
                return None
            if not (self.slots[index].alone and w.units):
                return index
        return None

    def _take(self, event: Event) -> None:
        if event.kind == "part":
            self.slots[event.unit].parts.append(event.payload)
        elif event.kind == "done":
            self.slots[event.unit].done = True
        else:
            for index in event.units:
                self._lost(self.slots[index], event.payload)

    def _lost(self, slot: _Slot, why: str) -> None:
        """A unit whose worker died: what it sent is dropped; scored again, alone, or given up on."""
        slot.attempt += 1
        if slot.alone:
            slot.parts, slot.done = [Poisoned(why)], True
            return
        slot.parts, slot.alone = [], True
        bisect.insort(self.pending, slot.unit.index)


def score_inputs_workers(pool: WorkerPool, inputs: list[Path], output: Path, errors: Path, spec: ReadSpec,
                         out: OutputSpec, progress: Callable[[int, int], None] | None = None, keyed: bool = False,
                         input_sha256: list[str] | None = None, unit_rows: int = UNIT_ROWS,
                         unit_bytes: int = UNIT_BYTES) -> Accounting:
    """pipeline.score_inputs with the pool's workers: the same files, bit for bit. The metadata also names the
    workers' devices. On any failure (Ctrl-C, SIGTERM) the workers are stopped and nothing is left behind."""
    if pool.policies is None:
        raise RuntimeError("WorkerPool.expect(policies) comes before scoring: the outputs' metadata needs them")
    run = RunOutput(pool.policies, Job(inputs, output, errors), spec, out, keyed, input_sha256)
    try:
        units = plan_units(inputs, spec, unit_rows, unit_bytes)
        _Schedule(pool, units, spec, out.strict, window=2 * DEPTH * len(pool.config.devices)).run(_Sink(run, progress))
        return run.commit(pool, workers=pool.devices)
    except BaseException:
        pool.close(clean=False)  # its workers may hold units of this run: they must not reach another one
        run.abort()
        raise
