"""The one reader of safetensors headers, for the model's checkpoint and the policies' adapters alike.

The format: an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}} (and an
optional __metadata__), then the data, each tensor at its [begin, end) offsets, back to back in offset order,
little-endian, row-major. The header is checked as safetensors checks it: a file it would refuse is refused,
with the file and the tensor named. No torch here: the `score --ray` driver reads adapters without it."""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from policyscan.engine import strict_json

SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
         "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}
MAX_HEADER = 100_000_000  # safetensors' own limit


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's place: its dtype as safetensors names it, its shape, and its bytes from the data's start."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True)
class Header:
    """A file's checked header: the data begins at byte `data_start` of the file."""

    path: Path
    data_start: int
    tensors: dict[str, TensorEntry]


def read_header(f: BinaryIO, path: Path, error: type[Exception]) -> Header:
    """The header of the open file `f` (at its start), checked against the file's size; `error` is raised with
    the path and what is wrong (CheckpointError for a model, PolicyError for an adapter)."""
    def fail(what: str) -> Exception:
        return error(f"{path}: {what}")

    raw = f.read(8)
    n = int.from_bytes(raw, "little") if len(raw) == 8 else -1
    if not 0 < n <= MAX_HEADER:
        raise fail("not a safetensors file (its first 8 bytes give no header length); it is truncated or another "
                   "format: save it again with safetensors")
    text = f.read(n)
    if len(text) < n:
        raise fail(f"the header is cut short ({len(text)} of {n} bytes): the file is truncated")
    try:
        header = strict_json.loads(text)
    except strict_json.DuplicateKeyError as e:  # a tensor named twice: which bytes hold it cannot be told
        raise fail(f"its header is ambiguous: {e}; the file is damaged") from e
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise fail(f"its header is not valid JSON ({e}); the file is damaged") from e
    except RecursionError as e:  # nested past Python's recursion limit: no safetensors header is
        raise fail("its header is JSON nested too deeply to be a safetensors header; the file is damaged") from e
    if not isinstance(header, dict):
        raise fail("its header is not a JSON object; the file is damaged")
    header.pop("__metadata__", None)
    tensors = {name: _entry(name, info, fail) for name, info in header.items()}
    _check_layout(tensors, os.fstat(f.fileno()).st_size - 8 - n, fail)
    return Header(path, 8 + n, tensors)


def open_header(path: Path, error: type[Exception]) -> Header:
    """read_header of the file at `path`."""
    with open(path, "rb", buffering=0) as f:
        return read_header(f, path, error)


def _entry(name: str, info, fail) -> TensorEntry:
    def ints(v, count: int | None = None) -> bool:
        return isinstance(v, list) and (count is None or len(v) == count) and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)
    dtype = info.get("dtype") if isinstance(info, dict) else None
    if not (isinstance(dtype, str) and dtype in SIZES and ints(info.get("shape"))
            and ints(info.get("data_offsets"), 2)):
        raise fail(f"tensor {name!r} has no valid dtype, shape and data_offsets in the header ({info!r}); the file "
                   "is damaged")
    begin, end = info["data_offsets"]
    if end - begin != math.prod(info["shape"]) * SIZES[dtype]:
        raise fail(f"tensor {name!r}: its bytes {begin}-{end} do not hold its shape {info['shape']} of {dtype}; the "
                   "file is damaged")
    return TensorEntry(dtype, tuple(info["shape"]), begin, end)


def _check_layout(tensors: dict[str, TensorEntry], size: int, fail) -> None:
    """Back to back from the data's start to its end (`size` bytes), as safetensors writes and requires."""
    at = 0
    for name, t in sorted(tensors.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if t.begin != at:
            raise fail(f"tensor {name!r} starts at data byte {t.begin}, not {at} where the one before it ended; the "
                       "file is damaged")
        at = t.end
    if at != size:
        cut = "truncated: copy or save it again" if at > size else "damaged (bytes after its tensors)"
        raise fail(f"its tensors need {at} data bytes and it holds {size}; the file is {cut}")
