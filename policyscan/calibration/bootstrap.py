"""Bootstrap intervals that are the same on every run: each replicate weighs every row by a Poisson(1) count drawn
from a hash of its id and the replicate's number (the Poisson bootstrap), so neither the rows' order nor a random
seed moves them, and rows that share an id are resampled together."""
from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import numpy as np

REPLICATES = 200
LEVEL = 0.95
METHOD = "Poisson bootstrap, each row's counts drawn from a hash of its id"
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
# P(count <= k) for Poisson(1), k = 0..19: past 19 the remaining mass is below 2^-53
_CDF = np.cumsum([math.exp(-1.0) / math.factorial(k) for k in range(20)])


def id_seeds(ids: list) -> np.ndarray:
    """64 bits per id, keyed apart from the holdout's hash (labeled.id_fraction), so the two choices are unrelated."""
    return np.fromiter((int.from_bytes(hashlib.blake2b(str(i).encode("utf-8", "backslashreplace"), digest_size=8,
                                                       person=b"ps-bootstrap").digest(), "little") for i in ids),
                       dtype=np.uint64, count=len(ids))


def counts(seeds: np.ndarray, replicate: int) -> np.ndarray:
    """Each row's count in one replicate: splitmix64 of (seed, replicate) as a uniform, through Poisson(1)'s CDF."""
    with np.errstate(over="ignore"):
        z = seeds + _GOLDEN * np.uint64(replicate + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    u = (z >> np.uint64(11)).astype(np.float64) * 2.0 ** -53
    return np.searchsorted(_CDF, u, side="right")


def intervals(ids: list, p: np.ndarray, y: np.ndarray, figures: Callable[[np.ndarray, np.ndarray], dict],
              replicates: int = REPLICATES, level: float = LEVEL) -> dict[str, list[float] | None]:
    """The central `level` interval of each figure `figures(p, y)` gives (a dict of floats or None) over the
    replicates; None for a figure undefined in more than half of them."""
    if replicates <= 0 or not len(ids):
        return {}
    seeds = id_seeds(ids)
    seen: dict[str, list[float]] = {}
    for r in range(replicates):
        idx = np.repeat(np.arange(len(ids)), counts(seeds, r))
        for name, value in figures(p[idx], y[idx]).items():
            vals = seen.setdefault(name, [])
            if value is not None:
                vals.append(value)
    tail = (1.0 - level) / 2.0 * 100.0
    return {name: [float(v) for v in np.percentile(vals, [tail, 100.0 - tail])] if 2 * len(vals) > replicates
            else None for name, vals in seen.items()}
