"""policyscan score: conversation logs in, calibrated per-policy probabilities out."""
from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path

import click
import pyarrow as pa
import pyarrow.parquet as pq

from ..engine.checkpoint import file_sha256
from ..engine.errors import PolicyscanError
from ..engine.pipeline import Accounting, OutputSpec, run_key, score_inputs, up_to_date
from ..engine.policy import load_policies
from ..engine.runner import Engine, EngineSettings
from ..engine.sinks import is_errors_file, meta_path, read_metadata
from ..engine.sources import ReadSpec
from .common import (EXIT_OK, EXIT_ROW_ERRORS, chat_template_option, check_lengths, check_writable_dir, clip_chars,
                     default_model, default_policies, engine_options, friendly_errors, input_files, model_option,
                     preload_arrow, protected_files, refuse_overwrites, resolve_chat_template)

SUFFIX_FORMATS = ((".parquet", "parquet"), (".jsonl", "jsonl"), (".jsonl.gz", "jsonl"))

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
@chat_template_option
@click.option("--id-column", default=None, metavar="C", help="id column passed through [default: id, else file:row]")
@click.option("--keep", multiple=True, metavar="C", help="pass this input column through; repeatable")
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
@click.option("--no-progress", is_flag=True, help="no progress bar")
@friendly_errors
def score(inputs, output, model, policies, text_column, messages_column, chat_template, id_column, keep, fmt, layout,
          raw, flagged, truncation, errors_path, strict, device, precision, batch_tokens, max_length, cuda_graphs,
          threads, no_progress) -> None:
    """Score INPUT files (Parquet, JSONL, JSONL.gz; files, directories or globs) against every policy.

    Exit status: 0 all rows scored, 3 finished with rows in the errors file, 2 usage error, 1 failure."""
    if text_column and messages_column:
        raise click.UsageError("give --text-column or --messages-column, not both")
    check_lengths(batch_tokens, max_length)
    files = input_files(list(inputs))
    per_input = output is not None and (output.endswith(("/", "\\")) or Path(output).is_dir())
    if errors_path and per_input:
        raise click.UsageError("--errors names one file; with -o DIR each input's errors go beside its output")
    fmt = _format(output, fmt, per_input)
    spec = ReadSpec(text_column, messages_column, id_column, tuple(keep), max_chars=clip_chars(max_length))
    out = OutputSpec(fmt, layout, raw, strict, flagged, truncation)
    pols = load_policies(list(policies) or list(default_policies()))
    model_dir = Path(model or default_model())
    jobs = _jobs(files, output, per_input, fmt, errors_path)
    _check_jobs(jobs, protected_files(files, model_dir, [p.path for p in pols]))
    template = resolve_chat_template(model_dir, chat_template, pols, files, spec)
    preload_arrow()
    engine = Engine(model_dir, pols, EngineSettings(device, precision, batch_tokens, max_length,
                                                    cuda_graphs=cuda_graphs, chat_template=template,
                                                    threads=threads))
    click.echo(f"policyscan: {len(engine.policies)} policies ({', '.join(p.name for p in engine.policies)}) on "
               f"{engine.checkpoint.model_dir} [{engine.checkpoint.config.arch}, {engine.precision}, {engine.device}]",
               err=True)
    total = Accounting()
    progress = not no_progress and _is_terminal()
    for job in jobs:
        sha = file_sha256(job.files[0]) if per_input else None
        # Only an existing output needs the run key before scoring: the key waits for the model's hash
        # (seconds for a large checkpoint), which a new output takes when it is written.
        if per_input and job.target.exists() and up_to_date(job.target, run_key(engine, spec, out, sha)):
            click.echo(f"{job.files[0]}: up to date ({job.target})", err=True)
            continue
        total.add(_run(engine, job, spec, out, progress, per_input, [sha] if sha else None))
    _summary(engine, total)
    sys.exit(EXIT_ROW_ERRORS if total.rows_in_errors or total.files_in_errors else EXIT_OK)


@dataclass(frozen=True)
class Job:
    """Inputs scored into one output and its errors file."""

    files: list[Path]
    target: Path
    errors: Path

    def __post_init__(self) -> None:
        if not self.files:
            raise ValueError("a job needs at least one input")


def _format(output: str | None, fmt: str | None, per_input: bool) -> str:
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


def _jobs(files: list[Path], output: str | None, per_input: bool, fmt: str, errors_path: str | None) -> list[Job]:
    if not per_input:
        target = Path(output) if output else Path(f"{_stem(files[0]) if len(files) == 1 else 'scores'}.scores.{fmt}")
        return [Job(files, target, _errors_for(target, errors_path))]
    out_dir = Path(output)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise click.UsageError(f"-o {output}: cannot create the folder ({e.strerror})") from e
    targets = [out_dir / f"{_stem(f)}.scores.{fmt}" for f in files]
    jobs = [Job([f], t, _errors_for(t, None)) for f, t in zip(files, targets)]
    names = [j.target for j in jobs]
    dup = {t for t in names if names.count(t) > 1}
    if dup:
        raise PolicyscanError(f"inputs with the same name would share an output: {sorted(map(str, dup))}")
    return jobs


def _check_jobs(jobs: list[Job], protected: dict[Path, str]) -> None:
    """Before anything is scored: each output can be written and destroys nothing policyscan did not write."""
    writes: list[tuple[Path, str]] = []
    for job in jobs:
        writes += [(job.target, "output"), (job.errors, "errors file")]
        if job.target.name.endswith((".jsonl", ".jsonl.gz")):
            writes.append((meta_path(job.target), "metadata file"))
    refuse_overwrites(writes, protected)
    for job in jobs:
        check_writable_dir(job.target.parent, f"output {job.target}")
        check_writable_dir(job.errors.parent, f"errors file {job.errors}")
        if job.target.is_file() and read_metadata(job.target) is None:
            raise click.UsageError(f"output {job.target} exists and is not a policyscan output; "
                                   "remove it or choose another -o")
        if job.errors.exists() and not is_errors_file(job.errors):
            raise click.UsageError(f"errors file {job.errors} exists and is not a policyscan errors file; "
                                   "remove it or choose another --errors")


def _is_terminal() -> bool:
    return sys.stderr.isatty()


def _stem(path: Path) -> str:
    name = path.name
    for suffix in (".jsonl.gz", ".parquet", ".jsonl", ".ndjson", ".json"):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return path.stem


def _errors_for(target: Path, given: str | None) -> Path:
    return Path(given) if given else target.with_name(target.name + ".errors.jsonl")


def _run(engine, job: Job, spec, out, progress, keyed, shas=None) -> Accounting:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=job.target.name, unit=" rows", dynamic_ncols=True, total=_parquet_rows(job.files))

    def tick(rows: int, tokens: int) -> None:
        bar.update(rows)
        bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s")

    try:
        acc = score_inputs(engine, job.files, job.target, job.errors, spec, out, tick if bar is not None else None,
                           keyed, shas)
    finally:
        if bar is not None:  # a tqdm without a total refuses bool()
            bar.close()
    err = f", {acc.rows_in_errors} rows in {job.errors}" if acc.rows_in_errors or acc.files_in_errors else ""
    click.echo(f"wrote {job.target}: {acc.rows_scored} rows{err}", err=True)
    return acc


def _parquet_rows(files: list[Path]) -> int | None:
    """The rows to come when every input is Parquet (its footer says), for the bar's total and ETA."""
    if not all(f.name.endswith(".parquet") for f in files):
        return None
    try:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except (OSError, pa.ArrowException):  # an unreadable file is reported when it is read
        return None


def _summary(engine: Engine, acc: Accounting) -> None:
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
    lines.append(_time_split(engine, acc))
    for p in engine.policies:
        n = acc.above_threshold.get(p.name, 0)
        share = n / acc.rows_scored if acc.rows_scored else 0.0
        lines.append(f"  {p.name}: {n} of {acc.rows_scored} above threshold {p.threshold} ({share:.1%})")
    click.echo("\n".join(lines))


def _time_split(engine: Engine, acc: Accounting) -> str:
    """Where the run's wall time went: a nightly job pays start-up and load as well as scoring."""
    from .main import STARTED

    whole = time.perf_counter() - STARTED
    startup = engine.load_started - STARTED
    rest = whole - startup - engine.load_seconds - acc.seconds
    gpu = " (GPU kernels compile inside the first batches of a fresh machine; Triton caches them on disk)" \
        if engine.device.type == "cuda" else ""
    return (f"time {whole:.2f} s = start-up {startup:.2f} s + load {engine.load_seconds:.2f} s + scoring "
            f"{acc.seconds:.2f} s{gpu} + the rest {rest:.2f} s (reading ahead, hashing, checks)")
