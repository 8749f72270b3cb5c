"""policyscan report: one self-contained HTML page over score outputs, and a review queue for people to label."""
from __future__ import annotations

import time
from pathlib import Path

import click

from policyscan.calibration.record import write_atomic
from policyscan.cli.common import friendly_errors, refuse_overwrites
from policyscan.engine.errors import InputError
from policyscan.report.aggregate import Selection, summarize
from policyscan.report.batches import MissingColumn
from policyscan.report.excerpts import find_conversations
from policyscan.report.outputs import check_together, find_outputs, open_output
from policyscan.report.review import check_review_path, queue_rows, write_review
from policyscan.report.run_page import run_page


@click.command("report")
@click.argument("outputs", nargs=-1, required=True)
@click.option("-o", "--output", "page", required=True, type=click.Path(dir_okay=False), metavar="REPORT.html",
              help="the page to write (one file: styles and plots inline, nothing fetched)")
@click.option("--inputs", "read_inputs", is_flag=True,
              help="show an excerpt of each listed row's conversation, read by id from the inputs the outputs "
                   "record (only while their sha256 is the recorded one)")
@click.option("--time-column", default=None, metavar="C",
              help="a time column the outputs kept (score --keep C): flags over time")
@click.option("--top", default=20, show_default=True, type=click.IntRange(0, 1000), metavar="N",
              help="rows listed per policy: the N highest flagged, and the N nearest the threshold")
@click.option("--review", default=None, type=click.Path(dir_okay=False), metavar="FILE",
              help="write a review queue (.parquet, .jsonl, .jsonl.gz): id, policy, p, the conversation and an "
                   "empty label column, which calibrate and evaluate read back once labeled")
@click.option("--review-rows", default=100, show_default=True, type=click.IntRange(1, 1 << 20), metavar="N",
              help="rows per policy in the review queue")
@click.option("--review-by", default="nearest", show_default=True, type=click.Choice(["nearest", "stratified"]),
              help="nearest: the rows nearest the threshold; stratified: a fixed sample from each tenth of p")
@friendly_errors
def report(outputs, page, read_inputs, time_column, top, review, review_rows, review_by) -> None:
    """Write an audit report of score OUTPUTs (files, folders of outputs, globs): provenance, row accounting and
    errors, flags per policy with the distribution of p, overlaps, flags over time, and the rows to look at.

    Outputs of different models or policies are refused: report them apart."""
    started = time.perf_counter()
    try:
        outs = [open_output(p) for p in find_outputs(list(outputs))]
        check_together(outs)
        if review:
            check_review_path(Path(review))
    except InputError as e:
        raise click.UsageError(str(e)) from e
    page_path = Path(page)
    if not page_path.parent.is_dir():
        raise click.UsageError(f"-o {page}: folder {page_path.parent} does not exist")
    protected = {o.path: "an output read by this report" for o in outs}
    protected.update({Path(r["abs_path"]): "an input of the outputs" for o in outs for r in o.meta.get("inputs", [])
                      if r.get("abs_path") and Path(r["abs_path"]).is_file()})
    refuse_overwrites([(page_path, "the report")] + ([(Path(review), "the review queue")] if review else []),
                      protected)
    try:
        s = summarize(outs, time_column, Selection(top, review_rows if review else 0, review_by))
    except MissingColumn as e:
        raise click.UsageError(str(e)) from e
    wanted: dict[int, set] = {}
    if read_inputs:
        for pol in s.policies:
            for r in pol.top.rows + pol.near.rows[:top]:
                wanted.setdefault(r.output, set()).add(r.id)
    if review:
        for _, r, _ in queue_rows(s, review_by, review_rows):
            wanted.setdefault(r.output, set()).add(r.id)
    conversations, notes = {}, []
    for o, ids in sorted(wanted.items()):
        found = find_conversations(outs[o], ids)
        conversations.update({(o, i): c for i, c in found.conversations.items()})
        notes += found.problems
    if review:
        settings = {k: outs[0].meta.get("settings", {}).get(k) for k in ("chat_template", "text_is_rendered")}
        done = write_review(Path(review), s, review_by, review_rows, conversations, settings)
        click.echo(f"wrote {done.path}: {done.rows} rows to review ({review_by}); label the 'label' column, then "
                   f"calibrate or evaluate it")
        if done.left_out:
            notes.append(f"{done.left_out} rows were left out of the review queue: their conversations were not "
                         "found in the recorded inputs")
            click.echo(f"warning: {done.left_out} rows left out of the review queue (conversations not found)",
                       err=True)
    write_atomic(page_path, run_page(s, conversations if read_inputs else {}, notes, time_column))
    for note in notes:
        click.echo(f"note: {note}", err=True)
    for pol in s.policies:
        rate = f"{pol.flagged / s.rows:.2%}" if s.rows else "n/a"
        click.echo(f"  {pol.name}: {pol.flagged:,} of {s.rows:,} flagged at threshold {pol.threshold:g} ({rate})")
    click.echo(f"wrote {page_path} ({len(outs)} outputs, {s.rows:,} conversations, "
               f"{s.errors.rows:,} error rows) in {time.perf_counter() - started:.1f} s")
