"""`policyscan score --ray`: the inputs' units read and scored on a Ray cluster (Ray Data), the outputs written
here, on the driver, by the local path's writers: the same files, metadata and row accounting, and bitwise the
same rows in input order (Ray Data keeps the units' order: preserve_order).

Ray restarts an actor that dies and runs its batch again (RETRIES times; a batch that kills its actor more often
ends the run, and the output being written is not left behind). An output whose input, model, policies and
settings are unchanged is skipped, as with -o DIR/ locally; deciding so needs the run's key, which a probe task
loads an Engine to take."""
from __future__ import annotations

import json
import time
import warnings
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import click
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from tokenizers import Tokenizer

from policyscan.engine.errors import PolicyscanError
from policyscan.engine.files import input_file_sha256
from policyscan.engine.inputs.rows import Chunk, ReadSpec
from policyscan.engine.inputs.units import Unit, plan_units
from policyscan.engine.outputs.accounting import Accounting, OutputSpec, file_failure, row_error
from policyscan.engine.outputs.run_output import Job, RunOutput, run_key, up_to_date
from policyscan.engine.outputs.columns import check_keep
from policyscan.engine.parallel.workers_proc import Failed
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.settings import EngineSettings
from policyscan.engine.text.chat_template import choose_template, read_tokenizer_config
from policyscan.engine.text.content import ContentGuard, Conversations
from policyscan.ray.cluster import connect, plan_actors, probe, unwrap
from policyscan.ray.read import ERROR, SOURCE, TEXT, pack, read_units, unpack
from policyscan.ray.returned import ReturnedRows
from policyscan.ray.scorer import PolicyScorer, scorer_columns

RETRIES = 3  # runs of a batch after the first, each after its actor died (Ray's default: without end)


class RayRun:
    """The run as the outputs' metadata records it: Engine.describe() and the model's file hashes as every actor
    reported them (they must agree: one kind of device, one model), or a probe's report when none came yet."""

    def __init__(self, policies: list[Policy], probe: Callable[[], tuple[dict, dict]], extra: dict):
        self.policies, self.extra, self._probe = policies, extra, probe
        self._seen: tuple[dict, dict] | None = None

    def add(self, blob: str) -> None:
        report = json.loads(blob)
        self._agree(report["describe"])
        self._seen = report["describe"], report["model_files"]

    def _agree(self, d: dict) -> None:
        if self._seen is None:
            return
        first = self._seen[0]
        # the tokenizer's backend may change within an actor (a gigatoken disagreement); its tokens do not
        differ = sorted(k for k in first.keys() | d.keys() if k != "tokenizer_backend" and first.get(k) != d.get(k))
        if differ:
            got = ", ".join(f"{k}: {d.get(k)} against {first.get(k)}" for k in differ)
            raise PolicyscanError(f"the Ray actors differ in {', '.join(differ)} ({got}); their scores would not be "
                                  "bitwise the same: give every node the same model files and one GPU model")

    def describe(self) -> dict:
        if self._seen is None:
            self._seen = self._probe()
        return self._seen[0]

    def file_hashes(self) -> dict:
        self.describe()
        return self._seen[1]


def score_on_ray(address: str, model_dir: Path, policies: list[Policy], settings: EngineSettings, jobs: list[Job],
                 spec: ReadSpec, out: OutputSpec, per_input: bool, workers: int, devices: str,
                 progress: bool) -> Accounting:
    """Score `jobs` on the cluster at `address` ("": RAY_ADDRESS, else the cluster `ray start` began here, else a
    new local one; the one this process already joined, if any); returns the total accounting."""
    # before the connect: a kept column named like one the scorer adds would be replaced by it
    check_keep(spec.keep, spec.id_column, {**scorer_columns([p.name for p in policies], True, True, True),
                                           **dict.fromkeys((TEXT, ERROR, SOURCE), "score --ray's readers")})
    ray, joined = connect(address)
    try:
        return _run(ray, model_dir, policies, settings, jobs, spec, out, per_input, workers, devices, progress)
    finally:
        if joined:  # now: left to the exit, Ray's own shutdown took several times as long (docs/performance.md)
            ray.shutdown()


def _run(ray, model_dir: Path, policies: list[Policy], settings: EngineSettings, jobs: list[Job], spec: ReadSpec,
         out: OutputSpec, per_input: bool, workers: int, devices: str, progress: bool) -> Accounting:
    actors, gpus, cpus = plan_actors(ray, settings, workers, devices)
    model = str(model_dir.resolve())
    bundles = [str(p.path.resolve()) for p in policies]
    run = RayRun(policies, partial(probe, ray, model, bundles, settings, gpus, cpus),
                 {"ray_version": ray.__version__, "actors": actors, "gpus_per_actor": gpus})
    each = f"{gpus:g} GPU" if gpus else f"{cpus:g} CPU"
    click.echo(f"policyscan: {len(policies)} policies ({', '.join(p.name for p in policies)}) on {model_dir} [Ray: "
               f"up to {actors} actor{'s' * (actors > 1)}, {each} each]", err=True)
    todo = []
    for job in jobs:
        sha = input_file_sha256(job.files[0]) if per_input else None
        if per_input and job.target.exists() and up_to_date(job.target, run_key(run, spec, out, sha)):
            click.echo(f"{job.files[0]}: up to date ({job.target})", err=True)
            continue
        # every input hashed before Ray reads any: a change after the hash is then seen when the output commits
        todo.append((job, [sha] if per_input else [input_file_sha256(f) for f in job.files]))
    units, job_of = [], []
    for j, (job, _) in enumerate(todo):
        for u in plan_units(job.files, spec):
            units.append(replace(u, index=len(units)))
            job_of.append(j)
    template = choose_template(model_dir, read_tokenizer_config(model_dir), settings.chat_template, policies)
    render = Conversations(template,
                           ContentGuard.of_tokenizer(Tokenizer.from_file(str(model_dir / "tokenizer.json"))),
                           settings.text_is_rendered)
    kwargs = dict(model=model, policies=bundles, settings=settings, text_column=TEXT, error_column=ERROR,
                  keep=(*spec.keep, SOURCE), raw=True, truncation=True, max_chars=spec.max_chars, provenance=True,
                  checked=True)
    batches = iter(())
    if units:
        # read with one character more than the limit: the scorer clips the rest and counts which texts it cut
        ds = read_units(units, replace(spec, max_chars=spec.max_chars + 1), render, packed=True)
        with warnings.catch_warnings():  # Ray 2.60 deprecates these two arguments and names nothing in their place
            warnings.simplefilter("ignore", DeprecationWarning)
            ds = ds.map_batches(_ChunkScorer, fn_constructor_kwargs=kwargs, batch_size=1, batch_format="pyarrow",
                                compute=ray.data.ActorPoolStrategy(min_size=1, max_size=actors), num_gpus=gpus,
                                num_cpus=cpus, max_restarts=-1, max_task_retries=RETRIES)
        ds.context.execution_options.preserve_order = True  # the outputs' rows in input order
        ds.context.enable_progress_bars = progress
        batches = (t for b in ds.iter_batches(batch_size=None, batch_format="pyarrow") for t in unpack(b))
    return _write(ray, batches, todo, units, job_of, run, spec, out, per_input)


class _ChunkScorer(PolicyScorer):
    """PolicyScorer on packed chunks (read_units(packed=True)), each scored alone and its rows packed."""

    def __call__(self, batch: pa.Table) -> pa.Table:
        score = super().__call__
        tables = [pack(score(t)) for t in unpack(batch)]
        return pa.concat_tables(tables) if tables else batch


def _write(ray, batches, todo: list[tuple[Job, list[str] | None]], units: list[Unit], job_of: list[int],
           run: RayRun, spec: ReadSpec, out: OutputSpec, keyed: bool) -> Accounting:
    """Each job's rows into its output, committed once its last unit is written (jobs come in order)."""
    total = Accounting()
    units_of: list[list[Unit]] = [[] for _ in todo]
    for u, k in zip(units, job_of):
        units_of[k].append(u)
    pending: pa.Table | None = None  # a batch's rows not written yet: those of a later job
    current: _Output | None = None
    try:
        for j, (job, shas) in enumerate(todo):
            current = _Output(job, shas, run.policies, spec, out, keyed, ReturnedRows(units_of[j]))
            while True:
                if pending is None:
                    t = time.perf_counter()
                    pending = unwrap(ray, lambda: next(batches, None))
                    current.acc.input_wait_seconds += time.perf_counter() - t
                    if pending is None:
                        break
                    for blob in filter(None, pending.column("provenance").to_pylist()):
                        run.add(blob)
                pending = current.take(pending, job_of, j)
                if pending is not None:  # the rest is a later job's: this one is complete
                    break
            total.add(current.commit(run))
            current = None
    except BaseException:
        if current is not None:
            current.abort()
        raise
    return total


class _Output:
    """One job's writers and accounting: the scorer's rows written as pipeline.score_chunk writes a chunk's."""

    def __init__(self, job: Job, shas: list[str] | None, policies: list[Policy], spec: ReadSpec, out: OutputSpec,
                 keyed: bool, returned: ReturnedRows):
        self.job, self.policies, self.keep, self.strict = job, policies, spec.keep, out.strict
        self.returned = returned
        self.run = RunOutput(policies, job, spec, out, keyed, shas)
        self.writer, self.err, self.acc = self.run.writer, self.run.err, self.run.acc

    def take(self, batch: pa.Table, job_of: list[int], j: int) -> pa.Table | None:
        """Write the batch's leading rows of job `j`; the rest (a later job's), or None."""
        units = batch.column(SOURCE).combine_chunks().field("unit").to_numpy()
        mine = int(np.searchsorted(np.asarray(job_of)[units], j, side="right"))  # units, and so jobs, come in order
        t = time.perf_counter()
        self._write(batch.slice(0, mine))
        self.acc.output_seconds += time.perf_counter() - t
        return batch.slice(mine) if mine < batch.num_rows else None

    def _write(self, t: pa.Table) -> None:
        src = t.column(SOURCE).combine_chunks()
        failed, end = (src.field(k).to_numpy(zero_copy_only=False) for k in ("failed", "end"))
        self.returned.see(src.field("unit").to_numpy(), src.field("row").to_numpy(), failed | end)
        if end.any():  # an end row stands for no input row
            t, failed = t.filter(pa.array(~end)), failed[~end]
        edges = [0, *(np.flatnonzero(failed[1:] != failed[:-1]) + 1), len(failed)]
        for lo, hi in zip(edges, edges[1:]):
            if hi > lo:
                (self._failed if failed[lo] else self._rows)(t.slice(lo, hi - lo))

    def _failed(self, t: pa.Table) -> None:
        src, errors = t.column(SOURCE).to_pylist(), t.column("error").to_pylist()
        for s, message in zip(src, errors):
            file_failure(Failed(s["file"], message, s["row"], s["total"]).failure(), self.err, self.acc, self.strict)

    def _rows(self, t: pa.Table) -> None:
        src = t.column(SOURCE).combine_chunks()
        errors = t.column("error").to_pylist()
        ids = t.column("id").combine_chunks()
        ok = np.array([e is None for e in errors], dtype=bool)
        self.acc.rows_in += len(errors)
        self.acc.rows_in_errors += int((~ok).sum())
        files, rows, lines = (src.field(k).to_pylist() for k in ("file", "row", "line"))
        for i in np.flatnonzero(~ok):  # in row order (one process lists a chunk's non-finite f after its others)
            where = Chunk(files[i], rows[i], ids.slice(i, 1), [], [errors[i]], [lines[i]] if lines[i] else None)
            row_error(where, 0, errors[i], self.err, self.strict)
        idx = pa.array(np.flatnonzero(ok))
        names = [p.name for p in self.policies]
        p, f, cut = (np.stack([t.column(f"{c}_{n}").combine_chunks().take(idx).to_numpy(zero_copy_only=False)
                               for n in names], axis=1) for c in ("p", "f", "truncated"))
        kept = ids.take(idx)
        self.writer.write(kept, {k: t.column(k).combine_chunks().take(idx) for k in self.keep}, p, f, cut)
        self.run.wrote(kept)
        self.acc.rows_scored += len(idx)
        self.acc.prompt_tokens += _sum(t.column("prompt_tokens"))
        self.acc.truncated_prompts += sum(_sum(t.column(f"truncated_{n}")) for n in names)
        self.acc.clipped_conversations += _sum(t.column("clipped"))
        for j, pol in enumerate(self.policies):
            self.acc.above_threshold[pol.name] += int((p[:, j] >= pol.threshold).sum())

    def commit(self, run: RayRun) -> Accounting:
        self.returned.finish()
        self.run.commit(run, ray=run.extra)
        err = f", {self.acc.rows_in_errors} rows in {self.job.errors}" \
            if self.acc.rows_in_errors or self.acc.files_in_errors else ""
        click.echo(f"wrote {self.job.target}: {self.acc.rows_scored} rows{err}", err=True)
        return self.acc

    def abort(self) -> None:
        self.run.abort()


def _sum(column: pa.ChunkedArray) -> int:
    """Of a count or flag column, nulls as 0."""
    return int(pc.sum(column).as_py() or 0)
