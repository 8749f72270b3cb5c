"""What a report shows, computed in one streaming pass over the outputs, in memory bounded by the number of
policies, histogram bins, hours and listed rows (never by the rows): per policy the flags, a histogram of p and
the rows to list, how often policies flag the same conversation, flags over time, and the row accounting."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from policyscan.report.batches import BATCH_ROWS, Batch, batches
from policyscan.report.errors import ErrorSummary, errors_file
from policyscan.report.kept import Kept, mix
from policyscan.report.outputs import ScoredOutput
from policyscan.report.timeline import Timeline, hours

BINS = 50  # histogram bins of p over [0, 1]
STRATA = 10  # equal-width bins of p a stratified review sample draws from in turn
ACCOUNTED = ("rows_in", "rows_scored", "rows_in_errors", "files_in_errors", "prompt_tokens", "truncated_prompts",
             "clipped_conversations", "duplicate_ids")


@dataclass(frozen=True)
class Selection:
    """How many rows to list: `top` highest and nearest the threshold per policy on the page, `review` rows per
    policy for the review queue, chosen by `review_by` (nearest or stratified)."""

    top: int = 20
    review: int = 0
    review_by: str = "nearest"

    def __post_init__(self) -> None:
        if self.top < 0 or self.review < 0:
            raise ValueError("row counts must be >= 0")
        if self.review_by not in ("nearest", "stratified"):
            raise ValueError(f"review_by {self.review_by!r}: nearest or stratified")


@dataclass
class PolicyFigures:
    """One policy across every output."""

    name: str
    threshold: float
    hist: np.ndarray = field(default_factory=lambda: np.zeros(BINS, dtype=np.int64))
    flagged: int = 0
    p_sum: float = 0.0
    top: Kept = field(default_factory=lambda: Kept(0))
    near: Kept = field(default_factory=lambda: Kept(0))
    sample: list[Kept] = field(default_factory=list)  # per stratum of p, for a stratified review sample


@dataclass
class Summary:
    """Everything the page and the review queue need."""

    outputs: list[ScoredOutput]
    policies: list[PolicyFigures]
    rows: int = 0
    rows_per_output: list[int] = field(default_factory=list)
    coflag: np.ndarray | None = None  # [k, k]: conversations flagged by both
    flag_counts: np.ndarray | None = None  # conversations flagged by 0, 1, .. k policies
    timeline: Timeline | None = None
    accounting: dict = field(default_factory=dict)
    errors: ErrorSummary = field(default_factory=ErrorSummary)


def summarize(outputs: list[ScoredOutput], time_column: str | None, sel: Selection,
              batch_rows: int = BATCH_ROWS) -> Summary:
    """One pass over every output's rows, `batch_rows` at a time (outputs already checked together: one model, one
    set of policies). The figures do not depend on the batch size."""
    first = outputs[0]
    k = len(first.policies)
    near_limit = max(sel.top, sel.review if sel.review_by == "nearest" else 0)
    # every stratum keeps enough rows to fill the sample alone: strata without rows leave their share to others
    per_stratum = sel.review if sel.review_by == "stratified" else 0
    pols = [PolicyFigures(n, t, top=Kept(sel.top), near=Kept(near_limit),
                          sample=[Kept(per_stratum) for _ in range(STRATA)] if per_stratum else [])
            for n, t in zip(first.policies, first.thresholds)]
    s = Summary(outputs, pols, coflag=np.zeros((k, k), dtype=np.int64), flag_counts=np.zeros(k + 1, dtype=np.int64),
                timeline=Timeline(k, {}) if time_column else None)
    thresholds = np.array(first.thresholds)
    for o, out in enumerate(outputs):
        row0 = 0
        for b in batches(out, time_column, batch_rows, with_f=sel.review > 0):  # f only for the review queue
            _add(s, b, o, row0, thresholds, time_column, out)
            row0 += len(b.ids)
        s.rows_per_output.append(row0)
        for key in ACCOUNTED:
            s.accounting[key] = s.accounting.get(key, 0) + int(out.meta["accounting"].get(key, 0))
        if (path := errors_file(out.path, out.meta)) is not None:
            s.errors.read(path)
    s.accounting["balanced"] = all(o.meta["accounting"].get("balanced", False) for o in outputs)
    return s


def _add(s: Summary, b: Batch, o: int, row0: int, thresholds: np.ndarray, time_column: str | None,
         out: ScoredOutput) -> None:
    p, n = b.p, len(b.ids)
    flags = p >= thresholds
    place = np.arange(s.rows, s.rows + n)
    fl = flags.astype(np.int64)
    s.coflag += fl.T @ fl
    s.flag_counts += np.bincount(fl.sum(axis=1), minlength=len(thresholds) + 1)
    if s.timeline is not None:
        s.timeline.add(hours(b.time, time_column, str(out.path)), fl, str(out.path))
    noise = mix(place) if s.policies[0].sample else None
    for j, pol in enumerate(s.policies):
        pj = p[:, j]
        pol.hist += np.bincount(np.minimum((pj * BINS).astype(np.int64), BINS - 1), minlength=BINS)
        pol.flagged += int(flags[:, j].sum())
        pol.p_sum += float(pj.sum())
        offer = (s.rows, o, row0, b.ids, p, b.f, b.time)
        pol.top.offer(np.where(flags[:, j], -pj, np.inf), *offer)
        pol.near.offer(np.abs(pj - pol.threshold), *offer)
        if pol.sample:
            stratum = np.minimum((pj * STRATA).astype(np.int64), STRATA - 1)
            for i, kept in enumerate(pol.sample):
                kept.offer(np.where(stratum == i, noise, np.inf), *offer)
    s.rows += n
