"""A safetensors file's tensors as float32 numpy arrays, read without torch: a process that only checks and
describes the policies (the `score --ray` driver) then never imports it (1.2-1.5 s).

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (and an
optional __metadata__), then the data, each tensor at its [begin, end) offsets, back to back in offset order,
little-endian, row-major. The header is checked as safetensors checks it: a file it would refuse is refused."""
from __future__ import annotations

import errno
import json
import math
import mmap
import os
import sys
from pathlib import Path

import numpy as np

from policyscan.engine.errors import PolicyError

_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
          "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
# bf16 is the top half of a float32: numpy has no bf16, so its bits are widened (exact, as torch's .float())
_FLOATS = {"F32": np.dtype("<f4"), "F16": np.dtype("<f2"), "F64": np.dtype("<f8"), "BF16": np.dtype("<u2")}
_MAX_HEADER = 100_000_000  # safetensors' own limit
_UNTRACKED = sys.version_info >= (3, 13)  # mmap(trackfd=False): no descriptor kept


class TensorFile:
    """The file's header, checked, and its data mapped copy-on-write, as safetensors' torch loader maps it (the
    page cache's own pages; writable for torch.from_numpy, though nothing writes them). 16 adapters of 97 MB
    took 0.27-0.30 s so on the 2 cores here, against 0.86-1.4 s read into this process's memory (every page of
    it faulted in) and 0.41-0.44 s with safetensors' torch loader. Before Python 3.13 a mapping holds a file
    descriptor: one per adapter for the run."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb", buffering=0) as f:
            raw = f.read(8)
            n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
            if not 0 < n <= _MAX_HEADER:
                raise self._error("not a safetensors file (its first 8 bytes give no header length); the adapter "
                                  "is truncated or another format: save it again with PEFT")
            text = f.read(n)
            if len(text) < n:
                raise self._error(f"the header is cut short ({len(text)} of {n} bytes): the file is truncated")
            try:
                header = json.loads(text)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise self._error(f"its header is not valid JSON ({e}); the file is damaged") from e
            except RecursionError as e:  # nested past Python's recursion limit: no safetensors header is
                raise self._error("its header is JSON nested too deeply to be a safetensors header; the file is "
                                  "damaged") from e
            if not isinstance(header, dict):
                raise self._error("its header is not a JSON object; the file is damaged")
            header.pop("__metadata__", None)
            self._entries = {name: self._entry(name, info) for name, info in header.items()}
            self._check_layout(os.fstat(f.fileno()).st_size - 8 - n)
            self._data = np.frombuffer(self._map(f), np.uint8, offset=8 + n)
        self.names = sorted(self._entries)

    def _map(self, f) -> mmap.mmap:
        try:
            m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY, **({"trackfd": False} if _UNTRACKED else {}))
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
        dtype, shape, begin, end = self._entries[name]
        if dtype not in _FLOATS:
            raise self._error(f"tensor {name!r} is {dtype}; LoRA factors must be floating point (F32, F16, BF16 "
                              "or F64)")
        t = self._data[begin:end].view(_FLOATS[dtype]).reshape(shape)
        if dtype == "BF16":
            return (t.astype(np.uint32) << 16).view(np.float32)
        t = t.astype(np.float32, copy=False)
        # a tensor after an odd count of 2-byte ones sits unaligned, and torch takes no unaligned array
        return t if t.flags.aligned else t.copy()

    def _entry(self, name: str, info) -> tuple[str, list[int], int, int]:
        def ints(v, count: int | None = None) -> bool:
            return isinstance(v, list) and (count is None or len(v) == count) and all(
                isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
        dtype = info.get("dtype") if isinstance(info, dict) else None
        if not (isinstance(dtype, str) and dtype in _SIZES and ints(info.get("shape"))
                and ints(info.get("data_offsets"), 2)):
            raise self._error(f"tensor {name!r} has no valid dtype, shape and data_offsets in the header "
                              f"({info!r}); the file is damaged")
        begin, end = info["data_offsets"]
        if end - begin != math.prod(info["shape"]) * _SIZES[info["dtype"]]:
            raise self._error(f"tensor {name!r}: its bytes {begin}-{end} do not hold its shape {info['shape']} of "
                              f"{info['dtype']}; the file is damaged")
        return info["dtype"], info["shape"], begin, end

    def _check_layout(self, size: int) -> None:
        """Back to back from the data's start to its end (`size` bytes), as safetensors writes and requires."""
        at = 0
        for name, (_, _, begin, end) in sorted(self._entries.items(), key=lambda kv: kv[1][2:]):
            if begin != at:
                raise self._error(f"tensor {name!r} starts at data byte {begin}, not {at} where the one before "
                                  "it ended; the file is damaged")
            at = end
        if at != size:
            cut = "truncated: copy or save it again" if at > size else "damaged (bytes after its tensors)"
            raise self._error(f"its tensors need {at} data bytes and it holds {size}; the file is {cut}")

    def _error(self, what: str) -> PolicyError:
        return PolicyError(f"{self.path}: {what}")

