"""Flags over time: rows and flags per policy counted by the hour of a time column (timestamps, dates or ISO 8601
strings; a time without a zone is taken as UTC), shown by the hour or, over more than three days, by the day."""
from __future__ import annotations

import datetime
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from policyscan.engine.errors import InputError

HOUR_US = 3_600_000_000
MAX_HOURS = 1 << 18  # about 30 years of hours: a column of nonsense times stops here
NO_TIME = np.iinfo(np.int64).min


def hours(values: pa.Array, column: str, where: str) -> np.ndarray:
    """Hours since the epoch (UTC) of each value; NO_TIME for a null."""
    t = values.type
    if pa.types.is_dictionary(t):
        values, t = values.dictionary_decode(), t.value_type
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        values = _parse(values, column, where)
    elif pa.types.is_date(t):
        values = values.cast(pa.timestamp("us"))
    elif not pa.types.is_timestamp(t):
        raise InputError(f"{where}: time column {column!r} has type {t}; give timestamps, dates or ISO 8601 strings "
                         "(epoch numbers are ambiguous: convert them)")
    us = values.cast(pa.timestamp("us", tz=values.type.tz)).cast(pa.int64()).to_numpy(zero_copy_only=False)
    mask = values.is_null().to_numpy(zero_copy_only=False)
    out = np.floor_divide(np.nan_to_num(us, nan=0).astype(np.int64), HOUR_US)
    out[mask] = NO_TIME
    return out


def _parse(values: pa.Array, column: str, where: str) -> pa.Array:
    """ISO 8601 strings as UTC timestamps: Arrow's parser for times with or without a zone, Python's for a mix."""
    for target in (pa.timestamp("us"), pa.timestamp("us", tz="UTC")):
        try:
            return pc.cast(values, target)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            continue
    out = []
    for v in values.to_pylist():
        if v is None:
            out.append(None)
            continue
        try:
            d = datetime.datetime.fromisoformat(v)
        except ValueError:
            raise InputError(f"{where}: time column {column!r} holds {v[:40]!r}, which is not an ISO 8601 date or "
                             "time") from None
        out.append(d.replace(tzinfo=datetime.timezone.utc) if d.tzinfo is None else d)
    return pa.array(out, pa.timestamp("us", tz="UTC"))


@dataclass
class Timeline:
    """Rows and flags per policy for every hour seen; rows without a time are counted apart."""

    policies: int
    counts: dict[int, np.ndarray]
    untimed: int = 0

    def add(self, hour: np.ndarray, flags: np.ndarray, where: str) -> None:
        timed = hour != NO_TIME
        self.untimed += int((~timed).sum())
        if not timed.any():
            return
        keys, inverse = np.unique(hour[timed], return_inverse=True)
        rows = np.bincount(inverse, minlength=len(keys))
        per = [np.bincount(inverse, weights=flags[timed, j], minlength=len(keys)) for j in range(self.policies)]
        for i, k in enumerate(keys.tolist()):
            acc = self.counts.setdefault(k, np.zeros(1 + self.policies, dtype=np.int64))
            acc[0] += rows[i]
            acc[1:] += np.array([int(c[i]) for c in per], dtype=np.int64)
        if len(self.counts) > MAX_HOURS:
            raise InputError(f"{where}: the time column spans more than {MAX_HOURS:,} hours; is it a time?")

    def series(self) -> tuple[str, list[tuple[str, int, list[int]]]]:
        """('hour' or 'day', [(label, rows, flags per policy)]) in time order, every step in between included."""
        if not self.counts:
            return "day", []
        first, last = min(self.counts), max(self.counts)
        step = 1 if last - first <= 72 else 24
        start = first - first % step
        buckets: dict[int, np.ndarray] = {}
        for h, acc in self.counts.items():
            b = buckets.setdefault((h - start) // step, np.zeros(1 + self.policies, dtype=np.int64))
            b += acc
        out = []
        for i in range((last - start) // step + 1):
            acc = buckets.get(i, np.zeros(1 + self.policies, dtype=np.int64))
            when = datetime.datetime.fromtimestamp((start + i * step) * 3600, datetime.timezone.utc)
            label = when.strftime("%Y-%m-%d %H:00") if step == 1 else when.strftime("%Y-%m-%d")
            out.append((label, int(acc[0]), [int(v) for v in acc[1:]]))
        return ("hour" if step == 1 else "day"), out
