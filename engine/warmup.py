"""Warm-up at load: one eager forward per batch shape class a scoring run meets, before the first real batch.

Why: a fresh process loads every Triton and Gluon kernel variant on its first call (from Triton's disk cache,
or compiling it), and variants multiply: Triton specializes integer arguments on being a multiple of 16 (the
token count, the last layer's sequence count), the FP8 GEMM takes the warp-specialized kernel above 2048 rows,
the Triton GEMM's program stride grows with its tile count, and the attention with a cached prefix is first
met by the first scored batch (the prefix cache's own prefill runs without one). Without a warm-up those loads
land inside the first scored chunk: `policyscan score` on W1 ran at 0.84x the warm engine (run 32,
bench/NOTES.md).

The synthetic batches change nothing: every row's result depends on that row alone (tests/test_invariance.py).
"""
from __future__ import annotations

import torch

from .batch import PackedBatch, pack
from .graphs import bucket
from .model import Decoder, PrefixCache


def warm_shapes(batch_tokens: int, graph_tokens: tuple[int, int] | None) -> list[tuple[int, int]]:
    """(tokens, sequences) of the warm-up batches.

    graph_tokens: (min, max) bucket of the CUDA-graph path, None when batches run eagerly. Eagerly run batches
    (above the graph path's max, or all of them without graphs) come in both residues mod 16, and with 16 to
    513 sequences so the pruned last layer meets its small-GEMM tile counts (1 to 5 row tiles of 128). A
    graph's capture runs its power-of-two bucket eagerly first: one forward per bucket up to the budget."""
    lo, hi = graph_tokens if graph_tokens is not None else (0, 0)
    shapes = []
    if batch_tokens > hi:
        t = max(hi + 16, 2064) if graph_tokens is not None else 2064  # above the FP8 GEMM's 2048-row switch
        shapes += [(t, 16), (t + 1, 17), (t + 1, 129), (t, 272), (t, 400), (t + 1, 513)]
    if graph_tokens is not None:
        t = lo
        while t <= min(hi, bucket(batch_tokens, lo)):
            shapes.append((t, 16))
            t *= 2
    else:
        shapes += [(256, 16), (257, 17)]  # small eager batches take the Triton GEMM
    return shapes


def synthetic_batch(tokens: int, seqs: int, n_policies: int) -> PackedBatch:
    """`seqs` sequences sharing `tokens` tokens as evenly as possible, policies in turn (sorted, as packed)."""
    if not 1 <= seqs <= tokens:
        raise ValueError(f"cannot split {tokens} tokens into {seqs} non-empty sequences")
    base, extra = divmod(tokens, seqs)
    lens = [base + (i < extra) for i in range(seqs)]
    return pack([[1] * n for n in lens], sorted(i % n_policies for i in range(seqs)))


def warm_up(decoder: Decoder, prefix: PrefixCache | None, n_policies: int, shapes: list[tuple[int, int]]) -> None:
    """Run `decoder.forward` once per shape, through the prefix cache when there is one, and wait for it."""
    with torch.inference_mode():
        for tokens, seqs in shapes:
            decoder.forward(synthetic_batch(tokens, seqs, n_policies).to(decoder.device), prefix)
    if decoder.device.type == "cuda":
        torch.cuda.synchronize(decoder.device)
