"""policyscan score: conversation logs in, calibrated per-policy probabilities out."""
from __future__ import annotations

import sys
from pathlib import Path

import click

from ..engine.checkpoint import file_sha256
from ..engine.errors import PolicyscanError
from ..engine.pipeline import Accounting, OutputSpec, run_key, score_inputs, up_to_date
from ..engine.policy import load_policies
from ..engine.runner import Engine, EngineSettings
from ..engine.sources import ReadSpec, expand_inputs
from .common import (EXIT_OK, clip_chars, EXIT_ROW_ERRORS, default_model, default_policies, engine_options,
                     friendly_errors, model_option, preload_arrow)


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
              help="column holding a list of {role, content}, rendered with the model's chat template")
@click.option("--id-column", default=None, metavar="C", help="id column passed through [default: id, else file:row]")
@click.option("--keep", multiple=True, metavar="C", help="pass this input column through; repeatable")
@click.option("--format", "fmt", default="parquet", show_default=True, type=click.Choice(["parquet", "jsonl"]))
@click.option("--layout", default="wide", show_default=True, type=click.Choice(["wide", "long"]),
              help="wide: a p_<policy> column per policy; long: one row per (conversation, policy)")
@click.option("--raw", is_flag=True, help="also write f_<policy> = logit(Violation) - logit(Compliant)")
@click.option("--errors", "errors_path", default=None, metavar="PATH",
              help="where rows that cannot be scored are listed [default: <output>.errors.jsonl]")
@click.option("--strict", is_flag=True, help="stop at the first row that cannot be scored")
@engine_options
@click.option("--no-progress", is_flag=True, help="no progress bar")
@friendly_errors
def score(inputs, output, model, policies, text_column, messages_column, id_column, keep, fmt, layout, raw,
          errors_path, strict, device, precision, batch_tokens, max_length, cuda_graphs, no_progress) -> None:
    """Score INPUT files (Parquet, JSONL, JSONL.gz; files, directories or globs) against every policy.

    Exit status: 0 all rows scored, 3 finished with rows in the errors file, 2 usage error, 1 failure."""
    files = expand_inputs(list(inputs))
    spec = ReadSpec(text_column, messages_column, id_column, tuple(keep), max_chars=clip_chars(max_length))
    out = OutputSpec(fmt, layout, raw, strict)
    per_input = output is not None and (output.endswith(("/", "\\")) or Path(output).is_dir())
    if errors_path and per_input:
        raise click.UsageError("--errors names one file; with -o DIR each input's errors go beside its output")
    preload_arrow()
    engine = Engine(model or default_model(), load_policies(list(policies) or list(default_policies())),
                    EngineSettings(device, precision, batch_tokens, max_length, cuda_graphs=cuda_graphs))
    click.echo(f"policyscan: {len(engine.policies)} policies ({', '.join(p.name for p in engine.policies)}) on "
               f"{engine.checkpoint.model_dir} [{engine.checkpoint.config.arch}, {engine.precision}, {engine.device}]",
               err=True)
    total = Accounting()
    progress = not no_progress and _is_terminal()
    if per_input:
        out_dir = Path(output)
        out_dir.mkdir(parents=True, exist_ok=True)
        targets = [(f, out_dir / f"{_stem(f)}.scores.{fmt}") for f in files]
        dup = {t for _, t in targets if [x for _, x in targets].count(t) > 1}
        if dup:
            raise PolicyscanError(f"inputs with the same name would share an output: {sorted(map(str, dup))}")
        for f, target in targets:
            sha = file_sha256(f)
            # Only an existing output needs the run key before scoring: the key waits for the model's hash
            # (seconds for a large checkpoint), which a new output takes when it is written.
            if target.exists() and up_to_date(target, run_key(engine, spec, out, sha)):
                click.echo(f"{f}: up to date ({target})", err=True)
                continue
            total.add(_run(engine, [f], target, _errors_for(target, None), spec, out, progress, True, [sha]))
    else:
        target = Path(output) if output else Path(f"{_stem(files[0]) if len(files) == 1 else 'scores'}.scores.{fmt}")
        total.add(_run(engine, files, target, _errors_for(target, errors_path), spec, out, progress, False))
    _summary(engine, total)
    sys.exit(EXIT_ROW_ERRORS if total.rows_in_errors or total.files_in_errors else EXIT_OK)


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


def _run(engine, files, target, errors, spec, out, progress, keyed, shas=None) -> Accounting:
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(desc=target.name, unit=" rows", dynamic_ncols=True)

    def tick(rows: int, tokens: int) -> None:
        bar.update(rows)
        bar.set_postfix_str(f"{tokens / max(bar.format_dict['elapsed'], 1e-9):,.0f} tok/s")

    try:
        acc = score_inputs(engine, files, target, errors, spec, out, tick if bar is not None else None, keyed, shas)
    finally:
        if bar is not None:  # a tqdm without a total refuses bool()
            bar.close()
    err = f", {acc.rows_in_errors} rows in {errors}" if acc.rows_in_errors or acc.files_in_errors else ""
    click.echo(f"wrote {target}: {acc.rows_scored} rows{err}", err=True)
    return acc


def _summary(engine: Engine, acc: Accounting) -> None:
    tps = acc.prompt_tokens / acc.seconds if acc.seconds else 0.0
    check = "balanced" if acc.balanced else "NOT BALANCED"
    lines = [f"rows in {acc.rows_in} = scored {acc.rows_scored} + in errors {acc.rows_in_errors} ({check})"]
    if acc.files_in_errors:
        lines.append(f"files that could not be read (see the errors file): {acc.files_in_errors}")
    lines.append(f"prompt tokens {acc.prompt_tokens:,} in {acc.seconds:.2f} s ({tps:,.0f} tokens/s; waiting for "
                 f"input {acc.input_wait_seconds:.2f} s, writing {acc.output_seconds:.2f} s); "
                 f"truncated prompts {acc.truncated_prompts}")
    for p in engine.policies:
        n = acc.above_threshold.get(p.name, 0)
        share = n / acc.rows_scored if acc.rows_scored else 0.0
        lines.append(f"  {p.name}: {n} of {acc.rows_scored} above threshold {p.threshold} ({share:.1%})")
    click.echo("\n".join(lines))
