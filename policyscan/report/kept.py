"""The few rows a report lists out of millions, chosen while the rows stream by: the `limit` rows with the smallest
keys (the highest p, the nearest to the threshold, a sample), ties going to the earlier row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pyarrow as pa


@dataclass(frozen=True)
class Row:
    """One listed conversation: which output, its row there, its id, p (and f) under every policy, its time."""

    output: int
    row: int
    id: object
    p: tuple[float, ...]
    f: tuple[float, ...] | None = None
    time: str | None = None

    def __post_init__(self) -> None:
        if self.f is not None and len(self.f) != len(self.p):
            raise ValueError("one f per policy")


class Kept:
    """The `limit` rows of smallest key offered so far, in key order."""

    def __init__(self, limit: int):
        if limit < 0:
            raise ValueError(f"limit {limit}")
        self.limit = limit
        self.keys = np.zeros(0)
        self.order = np.zeros(0, dtype=np.int64)  # a row's place among every row offered: ties keep the earlier
        self.rows: list[Row] = []

    def offer(self, keys: np.ndarray, first: int, output: int, row0: int, ids: pa.Array, p: np.ndarray,
              f: np.ndarray | None, time: pa.Array | None) -> None:
        """A batch's rows with their keys (inf: not a candidate); `first` is the batch's first row's place among all
        rows offered, `row0` its row in the output."""
        if self.limit == 0:
            return
        cand = np.flatnonzero(np.isfinite(keys))
        if len(self.keys) >= self.limit:
            cand = cand[keys[cand] < self.keys[-1]]
        if len(cand) > self.limit:
            cand = cand[np.argsort(keys[cand], kind="stable")[:self.limit]]
        if not len(cand):
            return
        take = pa.array(cand)
        new_ids = ids.take(take).to_pylist()
        new_times = [None if v is None else str(v) for v in time.take(take).to_pylist()] if time is not None \
            else [None] * len(cand)
        new = [Row(output, row0 + int(i), rid, tuple(float(v) for v in p[i]),
                   None if f is None else tuple(float(v) for v in f[i]), t)
               for i, rid, t in zip(cand, new_ids, new_times)]
        keys_all = np.concatenate([self.keys, keys[cand]])
        order_all = np.concatenate([self.order, first + cand])
        pick = np.lexsort((order_all, keys_all))[:self.limit]
        rows_all = self.rows + new
        self.keys, self.order, self.rows = keys_all[pick], order_all[pick], [rows_all[i] for i in pick]


def mix(order: np.ndarray) -> np.ndarray:
    """A fixed pseudo-random number in [0, 1) per row place (splitmix64): the sample is the same every run."""
    with np.errstate(over="ignore"):
        z = order.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0x632BE59BD9B4E019)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
