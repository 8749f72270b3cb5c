"""A safetensors file's tensors as float32 numpy arrays, read without torch: a process that only checks and
describes the policies (the `score --ray` driver) then never imports it. The header is engine/tensor_header.py's."""
from __future__ import annotations

import errno
import mmap
import sys
from pathlib import Path

import numpy as np

from policyscan.engine.errors import PolicyError
from policyscan.engine.tensor_header import read_header

# bf16 is the top half of a float32: numpy has no bf16, so its bits are widened (exact, as torch's .float())
_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}
UNTRACKED = sys.version_info >= (3, 13)  # mmap(trackfd=False): no descriptor kept


class TensorFile:
    """The file's header, checked, and its data mapped copy-on-write, as safetensors' torch loader maps it (the
    page cache's own pages; writable for torch.from_numpy, though nothing writes them): faster than reading
    every page into this process (docs/performance.md). Before Python 3.13 a mapping holds a file descriptor:
    one per adapter for the run."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb", buffering=0) as f:
            header = read_header(f, path, PolicyError)
            self._entries = header.tensors
            self._data = np.frombuffer(self._map(f), np.uint8, offset=header.data_start)
        self.names = sorted(self._entries)

    def _map(self, f) -> mmap.mmap:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY, **({"trackfd": False} if UNTRACKED else {}))
        except OSError as e:
            if e.errno == errno.EMFILE:
                raise self._error(f"too many files open to map it ({e}); raise the limit (`ulimit -n`) or score "
                                  "fewer policies at once") from e
            raise
        if hasattr(m, "madvise") and hasattr(mmap, "MADV_WILLNEED"):
            m.madvise(mmap.MADV_WILLNEED)  # a cold file read ahead whole, not a fault at a time
        return m

    def float32(self, name: str) -> np.ndarray:
        """The tensor as float32 (a view of the file's bytes when it is F32); not floating point: PolicyError."""
        entry = self._entries[name]
        dtype, shape, begin, end = entry.dtype, entry.shape, entry.begin, entry.end
        if dtype not in _FLOATS:
            raise self._error(f"tensor {name!r} is {dtype}; LoRA factors must be floating point (F32, F16, BF16 "
                              "or F64)")
        t = self._data[begin:end].view(_FLOATS[dtype]).reshape(shape)
        if dtype == "BF16":
            return (t.astype(np.uint32) << 16).view(np.float32)
        t = t.astype(np.float32, copy=False)
        # a tensor after an odd count of 2-byte ones sits unaligned, and torch takes no unaligned array
        return t if t.flags.aligned else t.copy()

    def _error(self, what: str) -> PolicyError:
        return PolicyError(f"{self.path}: {what}")

