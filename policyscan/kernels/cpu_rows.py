"""The CPU path's row-invariant products and its thread pool (kernels/reference.py's twins run on them).

Every row of a product, and of anything split by rows here, gets the same bits whatever else is in its batch and
however many threads run (tests/test_cpu_threads.py)."""
from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

ROW_BLOCK = 16  # rows are padded to a multiple of this in the CPU twins' products
_MIN_CHUNK = 256  # rows a pool thread takes at least: smaller products are not split
_POOL: ThreadPoolExecutor | None = None
_THREADS = 1
_INSIDE = threading.local()  # on: this thread runs one of _map's items


def set_threads(n: int) -> None:
    """Run the CPU twins on n threads: torch's own (OpenMP, MKL) pinned to 1, and a pool of n - 1 more Python
    threads, each at 1 torch thread, taking whole row chunks and whole sequences.
    Why: MKL splits K across its threads for some shapes, and then a row's product depends on how many rows
    share the call (2 threads: rows moved with M for K >= 1000 at N 16 to 512) and on the thread count; one
    thread's product gave every row the same bits for every M (K 512-4096, N 16-2048). And on a shared machine
    OpenMP's barriers collapsed: 2 of its threads ran many times slower than 1 (docs/performance.md)."""
    global _POOL, _THREADS
    if n < 1:
        raise ValueError(f"threads must be at least 1, got {n}")
    torch.set_num_threads(1)
    if _POOL is not None:
        _POOL.shutdown()
    _POOL = ThreadPoolExecutor(n - 1, "policyscan-cpu", torch.set_num_threads, (1,)) if n > 1 else None
    _THREADS = n


def map_items(fn: Callable, items: Iterable) -> list:
    """fn over items, on the pool's threads and this one: a chunk's result never depends on which thread ran it.
    Inside an item, serially: a pool thread waiting on its own queue would wait for ever."""
    items = list(items)
    if _POOL is None or len(items) < 2 or getattr(_INSIDE, "on", False):
        return [fn(i) for i in items]
    mode = torch.is_inference_mode_enabled()  # thread-local: the pool's threads take the caller's
    # every thread takes every n-th item, this one too: with this thread on the first alone, one pool thread took
    # all of a batch's sequences but one, and the pass waited on it (docs/performance.md)
    groups = [range(g, len(items), _THREADS) for g in range(_THREADS)]

    def run(group: range) -> list:
        _INSIDE.on = True
        try:
            with torch.inference_mode(mode):
                return [fn(items[k]) for k in group]
        finally:
            _INSIDE.on = False
    rest = [_POOL.submit(run, g) for g in groups[1:]]
    out = [None] * len(items)
    for group, results in zip(groups, [run(groups[0])] + [f.result() for f in rest]):
        for k, r in zip(group, results):
            out[k] = r
    return out


def product(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w^T over the last two dims (x [..., M, K], w [..., N, K]), each row's bits independent of M: rows
    padded to a multiple of 16, so the GEMM never takes its few-row kernel (a 1-row product took another
    kernel than a 37-row one: f moved in 20 of 20 batches, fp32). Outputs narrower than 16 columns (the LoRA
    shrink, short sequences' scores) take a GEMM 16 wide, w padded with zero rows: a GEMM that narrow still moved
    with the row's place in its block (K=33, N=7); batched ones, an elementwise product and a sum over K."""
    M, K, N = x.shape[-2], x.shape[-1], w.shape[-2]
    pad = (-M) % ROW_BLOCK
    if N < ROW_BLOCK and x.dim() == 2 and w.dim() == 2:  # a LoRA shrink: w's rows padded to 16 instead
        y = product(x, torch.cat([w, w.new_zeros(ROW_BLOCK - N, K)]))[:, :N]
        return y if out is None else out.copy_(y)
    if x.dim() == 2 and w.dim() == 2:  # linear layers: x not copied, its last block padded
        y = x.new_empty(M, N) if out is None else out
        main = M - M % ROW_BLOCK
        if main:
            torch.mm(x[:main], w.t(), out=y[:main])
        if pad:
            y[main:] = (torch.cat([x[main:], x.new_zeros(pad, K)]) @ w.t())[:M - main]
        return y
    if N < ROW_BLOCK:
        step = max(1, (1 << 22) // max(1, w.numel()))  # bound the [rows, N, K] temporary to ~4M elements
        y = torch.cat([(x[..., i:i + step, None, :] * w.unsqueeze(-3)).sum(-1) for i in range(0, max(M, 1), step)],
                      -2)
    else:
        xp = torch.cat([x, x.new_zeros(x.shape[:-2] + (pad, K))], -2) if pad else x
        y = (xp @ w.transpose(-1, -2))[..., :M, :]
    return y if out is None else out.copy_(y)


def rows_matmul(x: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """x @ w.T where each row's result does not depend on the other rows (batch invariance on the CPU), in
    16-row-aligned chunks over the pool's threads (set_threads); into `out` [M, N] when given."""
    M = x.shape[0]
    parts = min(_THREADS, M // _MIN_CHUNK)
    if parts < 2:
        return product(x, w, out)
    step = -(-M // parts // ROW_BLOCK) * ROW_BLOCK
    y = x.new_empty(M, w.shape[0]) if out is None else out
    map_items(lambda i: product(x[i:i + step], w, y[i:i + step]), range(0, M, step))
    return y


def by_rows(fn: Callable[[slice], None], M: int) -> None:
    """fn over 16-row-aligned slices of M rows on the pool's threads, each writing its rows of the caller's output
    in place: for work whose rows do not depend on each other (a projection's GEMM and its epilogue, which on one
    thread held the CPU path far below HF's speed). In place: concatenating the slices' results cost a tenth of a
    pass (docs/performance.md)."""
    parts = min(_THREADS, M // _MIN_CHUNK)
    if parts < 2:
        fn(slice(0, M))
        return
    step = -(-M // parts // ROW_BLOCK) * ROW_BLOCK
    map_items(lambda i: fn(slice(i, i + step)), range(0, M, step))
