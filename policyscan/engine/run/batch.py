"""Batches: which prompts go together under a token budget (plan_batches), and how they are packed back to back
with explicit metadata (pack -> PackedBatch)."""
from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class PackedBatch:
    """Token ids [T] of B sequences back to back; `cu_seqlens` [B+1]; one policy (adapter) index per sequence."""

    ids: torch.Tensor           # [T] int64
    cu_seqlens: torch.Tensor    # [B+1] int32
    seq_adapter: torch.Tensor   # [B] int32
    positions: torch.Tensor     # [T] int64, position inside its sequence
    token_adapter: torch.Tensor  # [T] int32
    max_seqlen: int

    def __post_init__(self) -> None:
        # checked on the host only: on a GPU the check would wait for the stream (and cannot run in a capture)
        if self.cu_seqlens.device.type == "cpu" and self.cu_seqlens[-1].item() != self.ids.numel():
            raise ValueError(f"cu_seqlens ends at {self.cu_seqlens[-1].item()}, "
                             f"but the batch has {self.ids.numel()} tokens")
        if self.seq_adapter.numel() != self.cu_seqlens.numel() - 1:
            raise ValueError("one adapter index per sequence is needed")

    @property
    def num_seqs(self) -> int:
        return self.seq_adapter.numel()

    @property
    def last_idx(self) -> torch.Tensor:
        return (self.cu_seqlens[1:] - 1).long()

    def to(self, device: torch.device | str) -> "PackedBatch":
        """On the device; from the host through pinned memory, so that the copy queues behind the work already
        on the stream instead of waiting for it (a copy from pageable memory makes the host wait)."""
        device = torch.device(device)
        pin = device.type == "cuda" and self.ids.device.type == "cpu"
        return PackedBatch(*((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in
                             (self.ids, self.cu_seqlens, self.seq_adapter, self.positions, self.token_adapter)),
                           max_seqlen=self.max_seqlen)


def pack(seqs: list[list[int]] | list[torch.Tensor], adapters: list[int]) -> PackedBatch:
    """Concatenate token-id sequences (each non-empty) with their adapter indices."""
    if len(seqs) != len(adapters):
        raise ValueError(f"{len(seqs)} sequences but {len(adapters)} adapter indices")
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    if (lens <= 0).any():
        raise ValueError("every sequence needs at least one token")
    if all(isinstance(s, list) for s in seqs):
        # one pass over the ints, several times faster on the host than torch.as_tensor per list then cat: it is
        # time before the GPU's first kernel of a run (docs/performance.md)
        ids = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lens.sum())))
    else:
        ids = torch.cat([torch.as_tensor(s, dtype=torch.int64) for s in seqs])
    cu = torch.zeros(len(seqs) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(lens, 0)
    starts = torch.repeat_interleave(cu[:-1].long(), lens)
    positions = torch.arange(ids.numel(), dtype=torch.int64) - starts
    seq_adapter = torch.as_tensor(adapters, dtype=torch.int32)
    return PackedBatch(ids, cu, seq_adapter, positions, torch.repeat_interleave(seq_adapter, lens),
                       int(lens.max()))


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
