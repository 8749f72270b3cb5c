"""JSONL(.gz) -> chunks, line by line (polars and pyarrow lose exact line numbers on a malformed line).

A byte that is not UTF-8 costs its own line only. The conversation column is picked
from the keys of the whole first chunk, so a first line without it costs that line only."""
from __future__ import annotations

import gzip
import io
import json
import re
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import BinaryIO

import pyarrow as pa

from policyscan.engine import strict_json
from policyscan.engine.errors import InputError
from policyscan.engine.files import open_regular
from policyscan.engine.inputs.rows import (
    Chunk,
    PartialFileError,
    ReadSpec,
    as_str,
    clip,
    conversation,
    conversation_candidates,
    json_id,
    pick_column,
    printable,
    surrogate,
)

_BAD_BYTE = re.compile("[\udc80-\udcff]")  # what errors="surrogateescape" makes of a byte that is not UTF-8
Parsed = tuple[int, dict | None, str | None]  # (line number, the object, or why the line is not one)


def parsed_lines(path: Path) -> Iterator[tuple[Parsed, int]]:
    """(parsed line, its length) for every non-blank line. A path that is not a regular file, or cannot be opened,
    raises InputError; a file that breaks (truncated gzip, a read error) raises OSError, EOFError or zlib.error
    after the lines before it."""
    raw = open_regular(path)
    with raw:  # bad bytes decode to U+DC80..U+DCFF (decoding stays in C) and are found line by line
        data = gzip.GzipFile(fileobj=raw, mode="rb") if path.name.endswith(".gz") else raw
        with io.TextIOWrapper(data, encoding="utf-8", errors="surrogateescape", newline="\n") as f:
            for line_no, line in enumerate(f, 1):
                if line.strip():  # blank lines are not rows
                    yield (line_no, *parse_line(_without_bom(line, line_no))), len(line)


def _without_bom(line: str, line_no: int) -> str:
    """The first line without the byte-order mark Windows tools put at a UTF-8 file's start (the line stays a row:
    whether a line is blank is decided with it, as the workers' row counts decide it)."""
    return line[1:] if line_no == 1 and line.startswith("\ufeff") else line


def parse_line(line: str) -> tuple[dict | None, str | None]:
    """(object, None) or (None, why this line is not a JSON object)."""
    if not line.isascii() and (m := _BAD_BYTE.search(line)):
        at = len(line[:m.start()].encode("utf-8", "surrogateescape")) + 1
        byte = ord(m.group()) - 0xdc00
        return None, f"invalid UTF-8 (byte 0x{byte:02x} at byte {at} of the line); the file must be UTF-8"
    try:
        obj = strict_json.loads(line)
    except json.JSONDecodeError as e:
        return None, f"malformed JSON ({e.msg} at column {e.colno})"
    except strict_json.DuplicateKeyError as e:
        return None, f"ambiguous JSON: {e}"
    except RecursionError:
        return None, "malformed JSON (nested too deeply to read)"
    if not isinstance(obj, dict):
        return None, f"line is a JSON {type(obj).__name__}, expected an object"
    return obj, None


def read_jsonl(path: Path, spec: ReadSpec, render: Callable[[list], str]) -> Iterator[Chunk]:
    """A gzipped file is checked whole first (gzip_damage): its checksum is read only at its end, after every line."""
    if path.name.endswith(".gz"):
        with open_regular(path) as raw:
            if (why := gzip_damage(raw)) is not None:
                raise InputError(f"{path}: {why}; no row of it can be trusted, so none is scored: replace it with an "
                                 "intact copy")
    yield from _chunks(path, spec, render, parsed_lines(path), _spec_column(spec))


def gzip_damage(raw: BinaryIO) -> str | None:
    """Why a gzip file's data cannot be trusted (a member whose checksum or length fails, or deflate data that is
    not valid), or None. It reads the file once, keeping nothing: a flipped byte would otherwise show only at the
    member's end, after the rows decoded from it were scored. A file that ends early, or holds bytes that are not
    gzip after its members, is not damaged in this sense: the reader scores what it read and names the rest."""
    d = zlib.decompressobj(wbits=31)  # gzip framing: the CRC-32 and length of each member are checked
    if not raw.read(1):  # a writer that died before its first byte: an empty gzip file still has a header
        return "it is empty (0 bytes), not gzip data, which holds a header even for no lines"
    raw.seek(0)
    buf = b""
    while buf or (buf := raw.read(1 << 22)):
        try:
            d.decompress(buf, 1 << 24)  # bounded output: 1 MB of input can inflate to 1 GB
            while d.unconsumed_tail:
                d.decompress(d.unconsumed_tail, 1 << 24)
        except zlib.error as e:
            return f"its gzip data is damaged ({e})"
        buf = b""
        if d.eof:  # a member ended: after zero padding another may follow, read on if the next bytes are short
            rest = d.unused_data.lstrip(b"\0")
            while len(rest) < 2 and (more := raw.read(1 << 22)):
                rest = (rest + more).lstrip(b"\0")
            if not rest.startswith(b"\x1f\x8b"):  # the end, or bytes that are not gzip: the reader names them
                return None
            d, buf = zlib.decompressobj(wbits=31), rest
    return None


def read_jsonl_range(path: Path, spec: ReadSpec, render: Callable[[list], str], start: int, end: int,
                     first_line: int, first_row: int, column: tuple[str, bool]) -> Iterator[Chunk]:
    """The rows of the whole lines in bytes [start, end) of a plain JSONL file, as read_jsonl gives them when it
    reads the whole file: line `first_line` is file row `first_row`, and `column` is the conversation column
    read_jsonl picks for the file (first_column)."""
    yield from _chunks(path, spec, render, _range_lines(path, start, end, first_line), column, first_row,
                       first_line - 1)


def first_column(path: Path, spec: ReadSpec) -> tuple[str, bool] | None:
    """The conversation column read_jsonl picks for `path`, when the spec or the file's first chunk settles it
    (None: that chunk holds no JSON object, so the pick waits for a later one). Raises InputError as read_jsonl."""
    if (picked := _spec_column(spec)) is not None:
        return picked
    pending: list[Parsed] = []
    chars = 0
    for parsed, size in parsed_lines(path):
        pending.append(parsed)
        chars += size
        if len(pending) >= spec.chunk_rows or chars >= spec.chunk_chars:
            break
    return _pick(spec, pending, path)


def _spec_column(spec: ReadSpec) -> tuple[str, bool] | None:
    if spec.text_column or spec.messages_column:
        return spec.text_column or spec.messages_column, spec.messages_column is not None
    return None


def _chunks(path: Path, spec: ReadSpec, render: Callable[[list], str], lines: Iterator[tuple[Parsed, int]],
            picked: tuple[str, bool] | None, row: int = 0, line_no: int = 0) -> Iterator[Chunk]:
    """Parsed lines -> chunks of at most spec.chunk_rows rows or about spec.chunk_chars characters, from file
    row `row` on; the column is picked from the first chunk that holds an object, unless `picked` says it."""
    pending: list[Parsed] = []
    chars = 0
    try:
        for parsed, size in lines:
            line_no = parsed[0]
            pending.append(parsed)
            chars += size
            if len(pending) >= spec.chunk_rows or chars >= spec.chunk_chars:
                picked = picked or _pick(spec, pending, path)
                yield _chunk(path, row, pending, picked, spec, render)
                row, pending, chars = row + len(pending), [], 0
    except (OSError, EOFError, zlib.error) as e:
        if pending:
            picked = picked or _pick(spec, pending, path)
            yield _chunk(path, row, pending, picked, spec, render)
            row += len(pending)
        raise PartialFileError(f"{path}: {_unreadable(e, line_no)}", row, None) from e
    if pending:
        picked = picked or _pick(spec, pending, path)
        yield _chunk(path, row, pending, picked, spec, render)


def _unreadable(e: BaseException, line_no: int) -> str:
    """What stopped the read after line `line_no`, said as what the file is."""
    if isinstance(e, EOFError):
        return f"ends after line {line_no}, before its gzip data does ({e}): it is truncated"
    if isinstance(e, gzip.BadGzipFile) and str(e).startswith("Not a gzipped file"):
        return (f"the bytes after line {line_no} are not gzip data ({e}), as if something was appended to the "
                "file; the lines before them were read")
    return f"unreadable after line {line_no} ({e}); is it truncated or damaged?"


def _range_lines(path: Path, start: int, end: int, first_line: int) -> Iterator[tuple[Parsed, int]]:
    """parsed_lines for the whole lines in bytes [start, end), split and decoded as parsed_lines does."""
    with open_regular(path) as f:
        f.seek(start)
        pos = start
        for line_no, raw in enumerate(f, first_line):  # binary lines end at b"\n" only, as newline="\n" splits
            pos += len(raw)
            if pos > end:
                break
            line = raw.decode("utf-8", "surrogateescape")
            if line.strip():
                yield (line_no, *parse_line(_without_bom(line, line_no))), len(line)
            if pos == end:
                return
    raise InputError(f"{path}: bytes {start} to {end} no longer hold the whole lines they held when the run "
                     "began; the file changed while it was scored: score it again once it is complete")


def _pick(spec: ReadSpec, pending: list[Parsed], path: Path) -> tuple[str, bool] | None:
    """The column, from every key of the chunk's objects in order of appearance (None: no object yet)."""
    objs = [obj for _, obj, _ in pending if obj is not None]
    if not objs:
        return None
    if not (spec.text_column or spec.messages_column):
        for line_no, obj, _ in pending:  # one line with two candidates: which one it means cannot be told
            if obj is not None and len(conversation_candidates(obj)) > 1:
                return pick_column(spec, list(obj), path, f" (line {line_no})")
    keys = list(dict.fromkeys(k for obj in objs for k in obj))
    found = conversation_candidates(keys)
    if len(found) > 1:  # lines that differ: the first candidate is the column, and a line without it is an error row
        keys = [found[0]] + [k for k in keys if k not in found]
    where = f" (the keys of lines {pending[0][0]} to {pending[-1][0]})"
    return pick_column(spec, keys, path, where)


def _chunk(path: Path, first_row: int, pending: list[Parsed], picked: tuple[str, bool] | None, spec: ReadSpec,
           render: Callable[[list], str]) -> Chunk:
    ids, texts, errors, lines = [], [], [], []
    keep: dict[str, list] = {k: [] for k in spec.keep}
    id_key = spec.id_column or "id"
    for line_no, obj, err in pending:
        fields = obj or {}
        text = None
        if obj is not None:
            text, err = _text(obj, picked, spec, render)
        rid, bad_id = json_id(fields[id_key], id_key) if id_key in fields else (f"{path.name}:{line_no}", None)
        if bad_id is not None:
            text, err = None, err or bad_id
        kept = {k: as_str(fields.get(k)) for k in spec.keep}
        if (bad := _bad_strings(rid, kept)) is not None:
            text, err = None, err or bad
            rid, kept = _printable(rid), {k: _printable(v) for k, v in kept.items()}
        ids.append(rid)
        texts.append(text)
        errors.append(err)
        lines.append(line_no)
        for k, v in kept.items():
            keep[k].append(v)
    return Chunk(str(path), first_row, pa.array(ids, pa.string()), texts, errors, lines,
                 {k: pa.array(v, pa.string()) for k, v in keep.items()}, clip(texts, spec.max_chars))


def _bad_strings(rid: str | None, kept: dict[str, str | None]) -> str | None:
    """Why the id or a kept field cannot be written (a lone surrogate), or None."""
    if (rid is None or rid.isascii()) and not kept:  # the common case, without building the list below
        return None
    for name, v in [("the id", rid), *((f"field {k!r}", v) for k, v in kept.items())]:
        if v is not None and (bad := surrogate(v)) is not None:
            return f"{name} {bad}"
    return None


def _printable(v: str | None) -> str | None:
    return None if v is None else printable(v)


def _text(obj: dict, picked: tuple[str, bool], spec: ReadSpec, render) -> tuple[str | None, str | None]:
    col, is_messages = picked
    if col not in obj:
        return None, f"no field {col!r}; this line has {list(obj)}"
    if spec.id_column and spec.id_column not in obj:
        return None, f"no field {spec.id_column!r} (--id-column); this line has {list(obj)}"
    return conversation(obj[col], is_messages, render)
