"""Stream a checkpoint's tensors to the device ahead of the loader, read in parallel threads.

safetensors' get_tensor copies a tensor out of a memory map into pageable memory, and a pageable copy to the GPU
is several times slower than a pinned one. Here threads read the tensors' bytes with preadv (no page faults; the
GIL released) into pinned staging buffers, which the loader's thread copies to the GPU asynchronously, at several
times the rate (docs/performance.md). The stream runs in the order the loader
asks: layer by layer, then the final norm and the embeddings, so that a tensor waits on the device only until the
rest of its layer arrived; a name outside the stream is read as before (Checkpoint.get)."""
from __future__ import annotations

import os
import re
import threading
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch

from policyscan.engine.errors import CheckpointError
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.tensor_header import open_header

DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64,
          "F8_E4M3": torch.float8_e4m3fn, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
          "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool}
SLOT_BYTES = 32 << 20  # a staging buffer; pinning host memory is slow (docs/performance.md): THREADS small ones, reused
THREADS = 8
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_LAST = ("model.norm.weight", "model.embed_tokens.weight")  # what the loader reads after the layers


@dataclass(frozen=True)
class Span:
    name: str
    path: Path
    offset: int  # in the file
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def spans(path: Path) -> dict[str, Span]:
    """Where each tensor of a safetensors file lies (its checked header), for the dtypes torch reads."""
    header = open_header(path, CheckpointError)
    return {name: Span(name, path, header.data_start + t.begin, t.end - t.begin, DTYPES[t.dtype], t.shape)
            for name, t in header.tensors.items() if t.dtype in DTYPES}


def checkpoint_spans(ckpt: Checkpoint) -> dict[str, Span]:
    """Where each tensor of the checkpoint lies, by name (the file the index names for it)."""
    found: dict[str, Span] = {}
    for path in sorted(set(ckpt.files.values())):
        found.update({k: v for k, v in spans(path).items() if ckpt.files.get(k) == path})
    return found


def stream_order(names: list[str]) -> list[str]:
    """The loader's order: each layer's tensors (by layer number), then the final norm and the embeddings."""
    layered = sorted((int(m.group(1)), n) for n in names if (m := _LAYER.match(n)))
    return [n for _, n in layered] + [n for n in _LAST if n in names]


class ReadAhead:
    """The checkpoint's layer, final-norm and embedding tensors streamed to `device` in stream_order; get(name)
    returns each (once), in any order, reading what lies before it in the stream onto the device meanwhile."""

    def __init__(self, ckpt: Checkpoint, device: torch.device):
        self.ckpt, self.device = ckpt, torch.device(device)
        found = checkpoint_spans(ckpt)
        self.order = [found[n] for n in stream_order(list(found))]
        self.chunks = [(i, lo, min(SLOT_BYTES, s.nbytes - lo)) for i, s in enumerate(self.order)
                       for lo in range(0, max(s.nbytes, 1), SLOT_BYTES)]
        gpu = self.device.type == "cuda"
        slot = min(SLOT_BYTES, max((s.nbytes for s in self.order), default=0))
        with torch.cuda.device(self.device) if gpu else nullcontext():  # cuda:N's context, not device 0's
            self.slots = [torch.empty(slot, dtype=torch.uint8, pin_memory=gpu) for _ in range(THREADS)]
        self.filled = [threading.Event() for _ in self.chunks]
        self.issued = [threading.Event() for _ in self.chunks]
        self.copied: list[torch.cuda.Event | None] = [None] * len(self.chunks)
        self.error: BaseException | None = None
        self.next = 0  # the next chunk to copy to the device
        self.partial: dict[str, torch.Tensor] = {}  # tensors whose first chunks are on their way
        self.ready: dict[str, torch.Tensor] = {}  # complete, not asked for yet (what a layer holds besides)
        self.taken: set[str] = set()
        self.index = {s.name: i for i, s in enumerate(self.order)}
        self.stop = False
        self.threads = [threading.Thread(target=self._read, args=(t,), name=f"policyscan-read-{t}", daemon=True)
                        for t in range(min(THREADS, len(self.chunks)))]
        for t in self.threads:
            t.start()

    def _read(self, t: int) -> None:
        view = memoryview(self.slots[t].numpy())
        fds: dict[Path, int] = {}
        try:
            for j in range(t, len(self.chunks), THREADS):
                if j >= THREADS:  # the slot's previous chunk must be on the device first
                    self.issued[j - THREADS].wait()
                    if self.copied[j - THREADS] is not None:
                        self.copied[j - THREADS].synchronize()
                if self.stop:
                    return
                i, lo, n = self.chunks[j]
                span = self.order[i]
                fd = fds.get(span.path)
                if fd is None:
                    fd = fds[span.path] = os.open(span.path, os.O_RDONLY)
                got = 0
                while got < n:  # a read may return less than asked (network file systems): only 0 is the end
                    part = os.preadv(fd, [view[got:n]], span.offset + lo + got)
                    if part == 0:
                        raise CheckpointError(f"{span.path}: ended {n - got} bytes early inside tensor "
                                              f"{span.name!r}; the file is truncated")
                    got += part
                self.filled[j].set()
        except BaseException as e:  # noqa: BLE001  handed to the loader's thread, which raises it
            self.error = e
            for ev in self.filled:
                ev.set()
        finally:
            for fd in fds.values():
                os.close(fd)

    def get(self, name: str) -> torch.Tensor:
        if name not in self.index:
            return self.ckpt.get(name).to(self.device)
        if name in self.taken:
            raise CheckpointError(f"{self.ckpt.model_dir}: tensor {name!r} was read once already")
        while name not in self.ready:
            self._copy_next()
        self.taken.add(name)
        return self.ready.pop(name)

    def _copy_next(self) -> None:
        j = self.next
        i, lo, n = self.chunks[j]
        span = self.order[i]
        self.filled[j].wait()
        if self.error is not None:
            raise self.error
        if lo == 0:
            self.partial[span.name] = torch.empty(span.shape, dtype=span.dtype, device=self.device)
        dst = self.partial[span.name].view(-1).view(torch.uint8)
        dst[lo:lo + n].copy_(self.slots[j % THREADS][:n], non_blocking=True)
        if self.device.type == "cuda":  # on the stream the copy went to: the target device's, not device 0's
            self.copied[j] = torch.cuda.Event()
            self.copied[j].record(torch.cuda.current_stream(self.device))
        self.issued[j].set()
        self.next += 1
        if lo + n >= span.nbytes:  # its last chunk: copies on this stream come before any use of it
            self.ready[span.name] = self.partial.pop(span.name)

    def close(self) -> None:
        """Stop reading (the tensors not asked for are dropped) and wait for the threads."""
        self.stop = True
        for ev in self.issued:
            ev.set()
        for t in self.threads:
            t.join()
        self.ready.clear()
        self.partial.clear()

    def __enter__(self) -> "ReadAhead":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
