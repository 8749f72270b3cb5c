"""Length buckets -> packed batches under a token budget, sequences of one adapter kept together."""
from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BatchPlan:
    """Which prompts go in one packed batch, in packing order (grouped by adapter)."""

    items: np.ndarray  # indices into the prompt list
    tokens: int


def plan_batches(lengths: np.ndarray, adapters: np.ndarray, budget: int) -> Iterator[BatchPlan]:
    """Sort prompts by length, cut into batches of at most `budget` tokens, then order each batch by adapter.

    Sorting by length keeps a batch's attention work even; ordering by adapter lets a GEMM tile usually
    see one adapter. Every prompt lands in exactly one batch."""
    lengths = np.asarray(lengths, dtype=np.int64)
    adapters = np.asarray(adapters, dtype=np.int64)
    if lengths.size and lengths.max() > budget:
        raise ValueError(f"a prompt of {int(lengths.max())} tokens exceeds the batch budget of {budget} tokens; "
                         "raise --batch-tokens or lower --max-length")
    order = np.lexsort((adapters, lengths))  # stable: ties keep input order, so plans are reproducible
    start, total = 0, 0
    for end, idx in enumerate(order):
        if total + lengths[idx] > budget:
            yield _plan(order[start:end], lengths, adapters)
            start, total = end, 0
        total += lengths[idx]
    if start < len(order):
        yield _plan(order[start:], lengths, adapters)


def _plan(chunk: np.ndarray, lengths: np.ndarray, adapters: np.ndarray) -> BatchPlan:
    chunk = chunk[np.argsort(adapters[chunk], kind="stable")]
    return BatchPlan(chunk, int(lengths[chunk].sum()))
