"""policyscan score: conversation logs in, calibrated per-policy probabilities out."""
from __future__ import annotations

import contextlib
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.cli.common import (
    EXIT_OK,
    EXIT_ROW_ERRORS,
    check_devices,
    check_lengths,
    conversation_options,
    default_model,
    default_policies,
    engine_options,
    friendly_errors,
    model_option,
    named_input_files,
    preload_arrow,
    protected_files,
    resolve_chat_template,
    template_arg,
)
from policyscan.cli.targets import Job, check_jobs, make_folders, output_format, plan_jobs
from policyscan.engine.errors import PolicyscanError
from policyscan.engine.files import input_file_sha256, not_regular
from policyscan.engine.inputs.rows import ReadSpec, clip_chars
from policyscan.engine.model.config import ModelConfig, read_config
from policyscan.engine.outputs.accounting import Accounting, OutputSpec
from policyscan.engine.outputs.run_output import run_key, up_to_date
from policyscan.engine.outputs.columns import check_keep, reserved_columns
from policyscan.engine.parallel.workers import WorkerConfig, WorkerPool, parse_devices
from policyscan.engine.parallel.workers_run import score_inputs_workers
from policyscan.engine.policy.bundle import Policy, load_policies
from policyscan.engine.run.pipeline import score_inputs
from policyscan.engine.settings import MAX_DEVICES, WORKERS_PER_CPU, EngineSettings, max_workers

if TYPE_CHECKING:  # torch: imported where this process scores, so that `score --ray` never loads it
    from policyscan.engine.run.runner import Engine


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("-o", "--output", default=None, metavar="PATH",
              help="output file, or a directory (existing, or ending in /) for one output per input, "
                   "skipping inputs whose output is up to date [default: ./<input>.scores.<format>]")
@model_option
@click.option("--policies", multiple=True, metavar="DIR",
              help="a policy bundle or a folder of bundles; repeatable "
                   "[default: $POLICYSCAN_POLICIES, else the samples]")
@click.option("--text-column", default=None, metavar="C", help="column holding the conversation as text")
@click.option("--messages-column", default=None, metavar="C",
              help="column holding a list of {role, content}, rendered with the chat template")
@conversation_options
@click.option("--id-column", default=None, metavar="C", help="id column passed through [default: id, else file:row]")
@click.option("--keep", multiple=True, metavar="C",
              help="pass this input column through; repeatable (a column named like an output column, such as "
                   "id or p_<policy>, is refused)")
@click.option("--format", "fmt", default=None, type=click.Choice(["parquet", "jsonl"]),
              help="[default: from -o's suffix (.parquet, .jsonl, .jsonl.gz), else parquet]")
@click.option("--layout", default="wide", show_default=True, type=click.Choice(["wide", "long"]),
              help="wide: a p_<policy> column per policy; long: one row per (conversation, policy)")
@click.option("--raw", is_flag=True, help="also write f_<policy> = logit(Violation) - logit(Compliant)")
@click.option("--flagged", is_flag=True, help="also write flagged_<policy> (long: flagged) = p >= its threshold")
@click.option("--mark-truncated", "truncation", is_flag=True,
              help="also write `truncated`: the prompt lost the conversation's oldest tokens (long: per policy)")
@click.option("--errors", "errors_path", default=None, metavar="PATH",
              help="where rows that cannot be scored are listed [default: <output>.errors.jsonl]")
@click.option("--strict", is_flag=True, help="stop at the first row that cannot be scored")
@engine_options
@click.option("--devices", default="all", show_default=True, metavar="all|N|I,J", callback=check_devices,
              help="GPUs to score on, one worker process and model copy each: all, the first N, or indices such "
                   f"as 0,2 (N up to {MAX_DEVICES}, indices below it; with --device auto or cuda; a single GPU scores "
                   "in this process)")
@click.option("--workers", default=1, show_default=True, type=click.IntRange(1, max_workers()), metavar="N",
              help="worker processes on the CPU (--device cpu), each with its own model copy and --threads; at most "
                   f"{WORKERS_PER_CPU} per CPU of this machine")
@click.option("--ray", "ray", is_flag=True,
              help="score on a Ray cluster (pip install 'policyscan[ray]'): --ray-address, else RAY_ADDRESS, else "
                   "the cluster `ray start` began here, else a new local one; outputs are written here")
@click.option("--ray-address", default=None, metavar="ADDRESS",
              help="the Ray cluster to join (HOST:PORT or ray://HOST:PORT); implies --ray")
@click.option("--no-progress", is_flag=True, help="no progress bar")
@friendly_errors
def score(inputs, output, model, policies, text_column, messages_column, chat_template, text_is_rendered, id_column,
          keep, fmt, layout, raw, flagged, truncation, errors_path, strict, device, precision, batch_tokens,
          max_length, cuda_graphs, fp8_flip_limit, threads, devices, workers, ray, ray_address, no_progress) -> None:
    """Score INPUT files (Parquet, JSONL, JSONL.gz; files, directories or globs) against every policy.

    Exit status: 0 all rows scored, 3 finished with rows in the errors file, 2 usage error, 1 failure."""
    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    check_lengths(batch_tokens, max_length, Path(model or default_model()))
    ray_address = ray_address if ray_address is not None else "" if ray else None
    if ray_address is not None:
        _check_no_address_among(inputs)
    # --keep's clashes but those with p_/f_/flagged_<policy>, before the inputs are listed or torch is imported;
    # those once the policies are read
    check_keep(keep, id_column, reserved_columns([], layout, raw, flagged, truncation))
    preload_arrow()  # first, so that its imports are done before the model load's thousands of GPU calls
    named = named_input_files(list(inputs))
    files = [f for f, _ in named]
    per_input = output is not None and (output.endswith(("/", "\\")) or Path(output).is_dir())
    if errors_path and per_input:
        raise click.UsageError("--errors names one file; with -o DIR each input's errors go beside its output")
    fmt = output_format(output, fmt, per_input)
    spec = ReadSpec(text_column, messages_column, id_column, tuple(keep), max_chars=clip_chars(max_length))
    out = OutputSpec(fmt, layout, raw, strict, flagged, truncation)
    bundles = tuple(policies) or default_policies()
    model_dir = Path(model or default_model())
    settings = EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs,
                              chat_template=template_arg(chat_template), text_is_rendered=text_is_rendered,
                              threads=threads, fp8_flip_limit=fp8_flip_limit)
    progress = not no_progress and _is_terminal()
    slots = None if ray_address is not None else _worker_devices(device, devices, workers)
    # the workers load the model while this process reads the policies and checks the inputs (done first, they
    # delayed the workers: docs/performance.md); pool.expect checks that the workers read the same policies
    with WorkerPool(WorkerConfig(model_dir, bundles, settings, slots)) if slots else contextlib.nullcontext() as pool:
        pols = load_policies(list(bundles))
        check_keep(keep, id_column, reserved_columns([p.name for p in pols], layout, raw, flagged, truncation))
        jobs = plan_jobs(named, output, per_input, fmt, errors_path)
        check_jobs(jobs, protected_files(files, model_dir, [p.path for p in pols]), folders_made_later=per_input)
        resolve_chat_template(model_dir, chat_template, pols, files, spec, text_is_rendered)
        length_note = _length_note(model_dir, settings)  # config.json read now: not after outputs are written
        make_folders(jobs)
        if ray_address is not None:
            from policyscan.ray.run import score_on_ray

            total = score_on_ray(ray_address, model_dir, pols, settings, jobs, spec, out, per_input, workers,
                                 devices, progress)
            _summary(pols, total, [], length_note)
        else:
            total = _score(pool, pols, jobs, model_dir, settings, spec, out, per_input, progress, length_note)
    sys.exit(EXIT_ROW_ERRORS if total.rows_in_errors or total.files_in_errors else EXIT_OK)


def _check_no_address_among(inputs: tuple[str, ...]) -> None:
    """`--ray HOST:PORT` (the address after the flag) leaves the address among the inputs: say what to type."""
    for item in inputs:
        if not Path(item).exists() and not any(c in item for c in "*?[") and (
                item.startswith("ray://") or re.fullmatch(r"[\w.-]+:\d+", item)):
            raise click.UsageError(f"{item!r} is not an input file; --ray is a flag now: name the cluster with "
                                   f"--ray-address {item}")


def _score(pool: WorkerPool | None, pols: list[Policy], jobs: list[Job], model_dir: Path, settings: EngineSettings,
           spec: ReadSpec, out: OutputSpec, per_input: bool, progress: bool, length_note: list[str]) -> Accounting:
    if pool is None:
        from policyscan.engine.run.runner import Engine

        engine = Engine(model_dir, pols, settings)
        click.echo(f"policyscan: {len(engine.policies)} policies ({', '.join(p.name for p in engine.policies)}) on "
                   f"{engine.checkpoint.model_dir} [{engine.checkpoint.config.arch}, {engine.precision}, "
                   f"{engine.device}]", err=True)
        total = _score_jobs(engine, jobs, spec, out, progress, per_input)
        notes = [_time_split(engine, total)]
        if engine.precision_reason:
            notes.append(f"precision {engine.precision}, not FP8 (--precision auto): {engine.precision_reason}")
        _summary(engine.policies, total, notes, length_note)
    else:
        pool.expect(pols)
        click.echo(f"policyscan: {len(pols)} policies ({', '.join(p.name for p in pols)}) on {model_dir} "
                   f"[{len(pool.devices)} workers: {', '.join(pool.devices)}]", err=True)
        total = _score_jobs(pool, jobs, spec, out, progress, per_input)
        deaths = [f"worker processes that died ({len(pool.deaths)}; their units went to the others): "
                  + "; ".join(pool.deaths)] if pool.deaths else []
        _summary(pool.policies, total, deaths, length_note)
    return total


def _score_jobs(scorer: Engine | WorkerPool, jobs: list[Job], spec, out, progress, per_input) -> Accounting:
    """scorer: an Engine, or a WorkerPool of them (run_key takes either: both describe() the run)."""
    total = Accounting()
    for job in jobs:
        sha = input_file_sha256(job.files[0]) if per_input else None
        # Only an existing output needs the run key before scoring: the key waits for the model's hash
        # (seconds for a large checkpoint), which a new output takes when it is written.
        if per_input and job.target.exists() and up_to_date(job.target, run_key(scorer, spec, out, sha)):
            click.echo(f"{job.files[0]}: up to date ({job.target})", err=True)
            continue
        total.add(_run(scorer, job, spec, out, progress, per_input, [sha] if sha else None))
    return total


def _worker_devices(device: str, devices: str, workers: int) -> tuple[str, ...] | None:
    """The worker processes' devices, or None to score in this process (one device, one worker)."""
    import torch

    if device == "cpu" or (device == "auto" and not torch.cuda.is_available()):
        return ("cpu",) * workers if workers > 1 else None
    if workers > 1:
        raise click.UsageError("--workers is for the CPU (--device cpu); on GPUs each of --devices gets one worker")
    if not torch.cuda.is_available():
        return None  # the Engine says no GPU is visible, as for a single device
    if device.startswith("cuda:"):
        if devices != "all":
            raise click.UsageError(f"--device {device} names one GPU; drop it to score on --devices {devices}")
        return None
    try:
        slots = parse_devices(devices, torch.cuda.device_count())
    except PolicyscanError as e:
        raise click.UsageError(str(e)) from e
    return slots if len(slots) > 1 else None


def _is_terminal() -> bool:
    return sys.stderr.isatty()


def _run(engine, job: Job, spec, out, progress, keyed, shas=None) -> Accounting:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=job.target.name, unit=" rows", dynamic_ncols=True, total=_parquet_rows(job.files))

    def tick(rows: int, tokens: int) -> None:
        bar.update(rows)
        bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s")

    try:
        scorer = score_inputs_workers if isinstance(engine, WorkerPool) else score_inputs
        acc = scorer(engine, job.files, job.target, job.errors, spec, out, tick if bar is not None else None,
                     keyed, shas)
    finally:
        if bar is not None:  # a tqdm without a total refuses bool()
            bar.close()
    err = f", {acc.rows_in_errors} rows in {job.errors}" if acc.rows_in_errors or acc.files_in_errors else ""
    click.echo(f"wrote {job.target}: {acc.rows_scored} rows{err}", err=True)
    return acc


def _parquet_rows(files: list[Path]) -> int | None:
    """The rows to come when every input is Parquet (its footer says), for the bar's total and ETA."""
    if not all(f.name.endswith(".parquet") and not_regular(f) is None for f in files):
        return None
    try:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except (OSError, pa.ArrowException):  # an unreadable file is reported when it is read
        return None


def _length_note(model_dir: Path, settings: EngineSettings) -> list[str]:
    """A line for the summary when the model's positions, fewer than --max-length, bound the prompts."""
    cap = ModelConfig.from_dict(read_config(model_dir)).prompt_length(settings.max_length)
    if cap == settings.max_length:
        return []
    return [f"prompts capped at {cap} tokens, the model's max_position_embeddings, below --max-length "
            f"{settings.max_length}: past them it would read positions it was never trained on"]


def _summary(policies: list[Policy], acc: Accounting, notes: list[str], capped: list[str]) -> None:
    """The row accounting, then `notes` (where the time went, a worker's death) and, when a prompt was cut,
    `capped` (what bound it: the metadata's max_length records it in every run), then each policy's flag count,
    saying so where a policy is uncalibrated (its p is then the model's own two-label softmax)."""
    tps = acc.prompt_tokens / acc.seconds if acc.seconds else 0.0
    check = "balanced" if acc.balanced else "NOT BALANCED"
    lines = [f"rows in {acc.rows_in} = scored {acc.rows_scored} + in errors {acc.rows_in_errors} ({check})"]
    if acc.files_in_errors:
        lines.append(f"files that could not be read (see the errors file): {acc.files_in_errors}")
    if acc.duplicate_ids:
        lines.append(f"duplicate ids: {acc.duplicate_ids} scored rows repeat the id of an earlier row of their output")
    lines.append(f"prompt tokens {acc.prompt_tokens:,} in {acc.seconds:.2f} s ({tps:,.0f} tokens/s; waiting for "
                 f"input {acc.input_wait_seconds:.2f} s, writing {acc.output_seconds:.2f} s); "
                 f"truncated prompts {acc.truncated_prompts}")
    lines += notes + (capped if acc.truncated_prompts else [])
    for p in policies:
        n = acc.above_threshold.get(p.name, 0)
        share = n / acc.rows_scored if acc.rows_scored else 0.0
        uncalibrated = "" if p.calibration else " (uncalibrated: policy.json holds no calibration, so p = sigmoid(f))"
        lines.append(f"  {p.name}: {n} of {acc.rows_scored} above threshold {p.threshold} ({share:.1%}){uncalibrated}")
    click.echo("\n".join(lines))


def _time_split(engine: Engine, acc: Accounting) -> str:
    """Where the run's wall time went: a nightly job pays start-up, load and compile as well as scoring."""
    from policyscan.cli import STARTED

    whole = time.perf_counter() - STARTED
    startup = engine.load_started - STARTED
    report = engine.compile
    compile_s = report.seconds if report else 0.0
    scoring = acc.seconds - acc.output_seconds
    rest = whole - startup - engine.load_seconds - compile_s - acc.seconds
    what = f" ({report.describe()})" if report else ""
    return (f"time {whole:.2f} s = start-up {startup:.2f} s + load {engine.load_seconds:.2f} s + compile "
            f"{compile_s:.2f} s{what} + scoring {scoring:.2f} s + writing {acc.output_seconds:.2f} s + the rest "
            f"{rest:.2f} s (reading ahead, hashing, checks)")