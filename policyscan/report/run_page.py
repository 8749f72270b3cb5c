"""The audit report of score outputs as one HTML page: what was found (flags per policy, the distribution of p,
overlaps, flags over time, the rows to look at) and what it rests on (provenance, row accounting, errors)."""
from __future__ import annotations

import datetime
from html import escape

import numpy as np

from policyscan.report.aggregate import Summary
from policyscan.report.kept import Row
from policyscan.report.page import cards, cell, document, pairs, para, section, table
from policyscan.report.svg import Axis, Series, chart, histogram

TIME_TABLE_ROWS = 120  # a timeline longer than this is shown as a chart only


def run_page(s: Summary, excerpts: dict, notes: list[str], time_column: str | None) -> str:
    """excerpts: (output index, id) -> Conversation for the listed rows (empty without --inputs); notes: lines
    about what could not be read."""
    names = [p.name for p in s.policies]
    span = f"{len(s.outputs)} output{'s' * (len(s.outputs) != 1)}, {s.rows:,} conversations"
    body = [_summary(s), _policies(s)]
    if len(names) > 1:
        body.append(_overlap(s))
    if s.timeline is not None:
        body.append(_timeline(s, time_column))
    body.append(_rows(s, excerpts))
    body.append(_errors(s))
    body.append(_provenance(s))
    if notes:
        body.append(section("Notes", [para(n) for n in notes], "notes"))
    return document("policyscan report", span, body)


def _rate(n: int, d: int) -> str:
    return f"{n / d:.2%}" if d else "n/a"


def _summary(s: Summary) -> str:
    acc = s.accounting
    items = [(f"{acc.get('rows_scored', 0):,}", "conversations scored", {"metric": "rows_scored"}),
             (f"{acc.get('rows_in_errors', 0):,}", "rows in errors files", {"metric": "rows_in_errors"})]
    items += [(f"{p.flagged:,}", f"flagged by {p.name} ({_rate(p.flagged, s.rows)})",
               {"metric": "flagged", "policy": p.name}) for p in s.policies]
    parts = [cards(items)]
    balanced = "balanced" if acc.get("balanced") else "NOT balanced"
    parts.append(para(f"rows in {acc.get('rows_in', 0):,} = scored {acc.get('rows_scored', 0):,} + in errors "
                      f"{acc.get('rows_in_errors', 0):,} ({balanced}), as the outputs' metadata records it; "
                      f"{acc.get('files_in_errors', 0):,} files in errors, {acc.get('truncated_prompts', 0):,} "
                      f"truncated prompts, {acc.get('duplicate_ids', 0):,} duplicate ids.",
                      "note" if acc.get("balanced") else "warn"))
    if s.rows != acc.get("rows_scored", 0):
        parts.append(para(f"The output files hold {s.rows:,} conversations but their metadata records "
                          f"{acc.get('rows_scored', 0):,} scored: a file was changed after it was written.", "warn"))
    return section("Summary", parts, "summary")


def _policies(s: Summary) -> str:
    cal = {p["name"]: p.get("calibration") or {} for p in s.outputs[0].meta["policies"]}
    rows = [[cell(p.name), cell(p.threshold, {"metric": "threshold", "policy": p.name}, 3),
             cell(s.rows), cell(p.flagged, {"metric": "flagged", "policy": p.name}),
             cell(p.flagged / s.rows if s.rows else None, {"metric": "flag_rate", "policy": p.name}),
             cell(p.p_sum / s.rows if s.rows else None, {"metric": "mean_p", "policy": p.name}),
             cell(f"a={cal[p.name].get('a', 1.0):.4g}, b={cal[p.name].get('b', 0.0):.4g}"),
             cell(cal[p.name].get("date", "never calibrated"))] for p in s.policies]
    plots = [histogram(p.hist, p.threshold, f"{p.name}: distribution of p") for p in s.policies]
    return section("Policies", [table(["policy", "threshold", "conversations", "flagged", "flag rate", "mean p",
                                       "calibration", "calibrated"], rows),
                                f'<div class="plots">{"".join(plots)}</div>'], "policies")


def _overlap(s: Summary) -> str:
    names = [p.name for p in s.policies]
    rows = []
    for i, a in enumerate(names):
        line = [cell(a)]
        for j, b in enumerate(names):
            both = int(s.coflag[i, j])
            share = f" ({both / s.coflag[i, i]:.0%})" if s.coflag[i, i] and i != j else ""
            line.append(f'<td class="n" data-metric="coflag" data-policy="{escape(a)}" data-other="{escape(b)}">'
                        f"{both:,}{share}</td>")
        rows.append(line)
    counts = [[cell(k), cell(int(n), {"metric": "flagged_by", "policies": str(k)}),
               cell(int(n) / s.rows if s.rows else None)] for k, n in enumerate(s.flag_counts)]
    return section("How often policies flag the same conversation", [
        para("Conversations flagged by both the row's and the column's policy; in brackets, the share of the row "
             "policy's flags that the column's policy also raised."),
        table(["flagged by"] + names, rows), table(["policies flagging", "conversations", "share"], counts)],
        "overlap")


def _timeline(s: Summary, column: str | None) -> str:
    step, series = s.timeline.series()
    parts = [para(f"By {step} of the column {column!r} (UTC); {s.timeline.untimed:,} rows without a time.")]
    if series:
        x = np.arange(len(series), dtype=np.float64)
        lines = [Series(p.name, x, np.array([f[j] / r if r else np.nan for _, r, f in series]),
                        dots=len(series) <= 60) for j, p in enumerate(s.policies)]
        ticks = range(len(series)) if len(series) <= 12 else \
            sorted(set(np.linspace(0, len(series) - 1, 6).round().astype(int).tolist()))
        top = max((v for ln in lines for v in ln.y if np.isfinite(v)), default=0.0)
        y_axis = Axis.up_to(top)
        x_axis = Axis(-0.5, len(series) - 0.5, tuple(float(t) for t in ticks),
                      tuple(series[t][0][5:] for t in ticks))  # without the year
        parts.append(f'<div class="plots">{chart(lines, "flag rate over time", step, "share flagged", x_axis, y_axis)}'
                     "</div>")
    if 0 < len(series) <= TIME_TABLE_ROWS:
        names = [p.name for p in s.policies]
        rows = [[cell(label), cell(r)] + [cell(f[j], {"metric": "flagged_at", "policy": n, "time": label})
                                          for j, n in enumerate(names)] for label, r, f in series]
        parts.append(table([step, "conversations"] + [f"flagged {n}" for n in names], rows))
    return section("Flags over time", parts, "timeline")


def _rows(s: Summary, excerpts: dict) -> str:
    names = [p.name for p in s.policies]
    parts = [] if excerpts else [para("Excerpts are not shown: pass --inputs to read them from the recorded "
                                      "inputs.")]
    for pol in s.policies:
        for title, rows in ((f"{pol.name}: top flagged rows", pol.top.rows),
                            (f"{pol.name}: rows nearest the threshold {pol.threshold:g}",
                             pol.near.rows[:pol.top.limit])):
            parts.append(f"<h3>{escape(title)}</h3>")
            if not rows:
                parts.append(para("none"))
                continue
            timed = ["time"] if s.timeline is not None else []
            parts.append(table(["id"] + [f"p {n}" for n in names] + timed + ["output", "excerpt"],
                               [_row(r, s, excerpts, pol.name) for r in rows]))
    return section("Rows to look at", parts, "rows")


def _row(r: Row, s: Summary, excerpts: dict, policy: str) -> list[str]:
    conv = excerpts.get((r.output, r.id))
    return ([cell(str(r.id), {"row-of": policy})] + [cell(v) for v in r.p] +
            ([cell(r.time or "")] if s.timeline is not None else []) + [cell(s.outputs[r.output].path.name),
             f'<td class="x">{escape(conv.excerpt()) if conv else ""}</td>'])


def _errors(s: Summary) -> str:
    e = s.errors
    parts = []
    if not e.counts:
        parts.append(para("No errors files: every row was scored." if not s.accounting.get("rows_in_errors")
                          else "The errors files the outputs name were not found.", "note"))
    else:
        rows = [[cell(kind), cell(n, {"metric": "errors", "reason": kind}),
                 cell(f"{e.examples[kind].get('file')}, row {e.examples[kind].get('row')}, line "
                      f"{e.examples[kind].get('line')}, id {e.examples[kind].get('id')}: "
                      f"{e.examples[kind].get('reason')}")] for kind, n in e.counts.most_common()]
        parts.append(table(["reason", "rows", "first example"], rows))
    parts += [para(f"errors file not found or not a policyscan errors file: {m}", "warn") for m in e.missing]
    return section("Errors by reason", parts, "errors")


def _provenance(s: Summary) -> str:
    m = s.outputs[0].meta
    model = m.get("model", {})
    parts = ["<h3>Model</h3>", pairs([("path", model.get("path")), ("sha256", model.get("sha256")),
                                     ("architecture", model.get("arch")),
                                     ("FP8 checkpoint", model.get("fp8_checkpoint"))]
                                    + [(f"file {k}", v) for k, v in sorted((m.get("model_files") or {}).items())])]
    pol_rows = [[cell(p["name"]), f'<td class="h">{escape(str(p.get("adapter_sha256") or "prompt only"))}</td>',
                 cell(p.get("threshold")), cell(str((p.get("calibration") or {}).get("data_sha256", "")))]
                for p in m["policies"]]
    parts += ["<h3>Policies</h3>", table(["policy", "adapter sha256", "threshold", "calibration data sha256"],
                                         pol_rows)]
    out_rows = []
    for o, n in zip(s.outputs, s.rows_per_output):
        acc, meta = o.meta["accounting"], o.meta
        # when score committed it, as its metadata records; the file's time for outputs from before that record
        written = meta.get("written_at") or datetime.datetime.fromtimestamp(
            o.path.stat().st_mtime, datetime.timezone.utc).isoformat(timespec="seconds") + " (file time)"
        out_rows.append([cell(str(o.path)), cell(written), cell(n),
                         cell(int(acc.get("rows_in", 0))), cell(int(acc.get("rows_in_errors", 0))),
                         cell(bool(acc.get("balanced"))), cell(meta.get("device")), cell(meta.get("precision")),
                         cell(meta.get("policyscan_version"))])
    parts += ["<h3>Outputs</h3>", table(["output", "written", "conversations", "rows in", "in errors",
                                         "balanced", "device", "precision", "policyscan"], out_rows)]
    inputs = [(o.path.name, rec) for o in s.outputs for rec in o.meta.get("inputs", [])]
    parts += ["<h3>Inputs</h3>", table(["output", "input", "sha256", "changed while read"],
                                       [[cell(name), cell(rec.get("path")),
                                         f'<td class="h">{escape(str(rec.get("sha256")))}</td>',
                                         cell(bool(rec.get("changed_while_read")))] for name, rec in inputs[:500]])]
    if len(inputs) > 500:
        parts.append(para(f"... and {len(inputs) - 500:,} more inputs."))
    numerics = m.get("numerics") or {}
    parts += ["<h3>Settings (of the first output)</h3>", pairs(
        [("policyscan", m.get("policyscan_version")), ("torch", m.get("torch_version")),
         ("device", m.get("device")), ("GPU", m.get("gpu")), ("CUDA", m.get("cuda_version")),
         ("Triton", m.get("triton_version")), ("precision", m.get("precision")),
         ("precision reason", m.get("precision_reason")),
         ("numerics", ", ".join(f"{k}={v}" for k, v in numerics.items())),
         ("tokenizer", m.get("tokenizer_backend")),
         ("chat template", (m.get("chat_template") or {}).get("sha256") if isinstance(m.get("chat_template"), dict)
          else m.get("chat_template"))]
        + [(f"setting {k}", v) for k, v in sorted((m.get("settings") or {}).items())])]
    differ = sorted({k for o in s.outputs[1:] for k in ("device", "precision", "settings", "policyscan_version")
                     if o.meta.get(k) != m.get(k)})
    if differ:
        parts.append(para(f"The outputs differ in: {', '.join(differ)} (see the outputs table).", "warn"))
    return section("Provenance", parts, "provenance")
