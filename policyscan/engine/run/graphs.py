"""CUDA graphs of Decoder.forward, captured per (token bucket, sequence bucket) and replayed.

A batch of T tokens in B sequences runs in the graph of the smallest buckets T' >= T and B' > B (powers of
two): its tokens are copied into the graph's static buffers and the rest is padding, one padding sequence
holding the spare tokens (adapter -1: no LoRA) and empty sequences the spare slots. Every kernel's grid
depends only on T' and B' (the attention kernel walks a device-side work list), and rows never depend on
the rest of the batch, so a replayed batch gives bitwise what the eager forward gives (tests/test_gpu_engine).

Why only small batches: a forward launches about ten kernels per layer, each with host work (the GEMM
builds two TMA descriptors per launch); a batch of many thousand tokens keeps the GPU busy long enough to
hide that (a large run's GPU time is nearly all of its wall time), but a batch of a few thousand tokens or
fewer (the tail of every file a cron job scores) runs in about the time its launches take, and replayed it
runs about twice as fast (docs/performance.md). Padding (buckets are powers of two) costs at most 2x
the tokens of a small batch and nothing above `max_tokens`, which runs eagerly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from policyscan.engine.model.model import Decoder, PrefixCache
from policyscan.engine.run.batch import PackedBatch


def _bucket(n: int, least: int) -> int:
    return max(least, 1 << max(0, n - 1).bit_length())


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    batch: PackedBatch   # static inputs on the device
    out: torch.Tensor    # static f [B']
    tables: tuple[torch.Tensor, ...]  # the rope tables it reads: kept alive if the cache regrows


class GraphedForward:
    """`decoder.forward(batch, prefix)` for host-side batches: replayed from a CUDA graph when the batch has
    at most `max_tokens` tokens, eager otherwise. Returns f [B] on the device (a copy: safe to keep)."""

    MAX_TOKENS, MIN_TOKENS = 4096, 256  # the token buckets' range (the module docstring says why)

    def __init__(self, decoder: Decoder, prefix: PrefixCache | None, max_tokens: int = MAX_TOKENS,
                 min_tokens: int = MIN_TOKENS):
        if decoder.device.type != "cuda":
            raise ValueError("CUDA graphs need the decoder on a CUDA device")
        if max_tokens < 1 or min_tokens < 1:
            raise ValueError(f"token buckets must be positive, got max {max_tokens}, min {min_tokens}")
        self.decoder, self.prefix = decoder, prefix
        self.max_tokens, self.min_tokens = max_tokens, min_tokens
        self.pool = torch.cuda.graph_pool_handle()  # graphs run one at a time: one memory pool for all
        self.graphs: dict[tuple[int, int], _Graph] = {}

    def __call__(self, batch: PackedBatch) -> torch.Tensor:
        T, B = batch.ids.numel(), batch.num_seqs
        if T > self.max_tokens:
            return self.decoder.forward(batch.to(self.decoder.device), self.prefix)
        key = (_bucket(T, self.min_tokens), _bucket(B + 1, 8))
        g = self.graphs.get(key) or self._capture(*key)
        fill(g.batch, batch)
        g.graph.replay()
        return g.out[:B].clone()

    def _capture(self, T: int, B: int) -> _Graph:
        dev = self.decoder.device
        static = static_batch(T, B, dev)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):  # compiles the kernels and sizes the rope tables outside the capture
            self.decoder.forward(static, self.prefix)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = self.decoder.forward(static, self.prefix)
        tables = self.decoder.rope_tables(T + (self.prefix.longest if self.prefix is not None else 0))
        self.graphs[(T, B)] = _Graph(graph, static, out, tables)
        return self.graphs[(T, B)]


def static_batch(T: int, B: int, device: torch.device | str) -> PackedBatch:
    """A graph's input buffers: T tokens in B sequence slots (all tokens in the first, for the capture)."""
    return PackedBatch(torch.zeros(T, dtype=torch.int64, device=device),
                       torch.tensor([0] + [T] * B, dtype=torch.int32, device=device),
                       torch.full((B,), -1, dtype=torch.int32, device=device),
                       torch.arange(T, dtype=torch.int64, device=device),
                       torch.full((T,), -1, dtype=torch.int32, device=device), max_seqlen=T)


def fill(static: PackedBatch, batch: PackedBatch) -> None:
    """Copy a host batch into a graph's buffers: real tokens first, then one padding sequence of the spare
    tokens (adapter -1, positions from 0), then empty sequences."""
    T, B = batch.ids.numel(), batch.num_seqs
    Tp, Bp = static.ids.numel(), static.num_seqs
    if T > Tp or B >= Bp:
        raise ValueError(f"a batch of {T} tokens in {B} sequences does not fit buffers of {Tp} tokens, {Bp} slots "
                         "(one slot is the padding sequence's)")
    ids = torch.zeros(Tp, dtype=torch.int64)
    ids[:T] = batch.ids
    pos = torch.arange(Tp, dtype=torch.int64) - T
    pos[:T] = batch.positions
    tok_ad = torch.full((Tp,), -1, dtype=torch.int32)
    tok_ad[:T] = batch.token_adapter
    cu = torch.full((Bp + 1,), Tp, dtype=torch.int32)
    cu[:B + 1] = batch.cu_seqlens
    seq_ad = torch.full((Bp,), -1, dtype=torch.int32)
    seq_ad[:B] = batch.seq_adapter
    for dst, src in ((static.ids, ids), (static.positions, pos), (static.token_adapter, tok_ad),
                     (static.cu_seqlens, cu), (static.seq_adapter, seq_ad)):
        # pinned: the copy is queued behind the previous replay without blocking the host (a pageable
        # source would make the host wait for the stream)
        dst.copy_(src.pin_memory() if dst.is_cuda else src, non_blocking=dst.is_cuda)
