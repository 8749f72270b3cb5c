"""The conversations of a few listed rows, read by id from the inputs an output's metadata records (found where
it was scored, else relative to the output, and only while their sha256 is still the recorded one). Only the id
and conversation columns are read, batch by batch, and only the wanted rows are kept; every input is read to the
end, so that an id naming two rows is found out."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from policyscan.engine.errors import InputError
from policyscan.engine.files import cached_sha256
from policyscan.engine.inputs.jsonl import first_column, parsed_lines
from policyscan.engine.inputs.rows import ReadSpec, as_str
from policyscan.engine.inputs.sources import parquet_layout
from policyscan.report.outputs import ScoredOutput

EXCERPT_CHARS = 280


@dataclass(frozen=True)
class Conversation:
    """A row's conversation as its input holds it: a text or a list of messages, and the column it came from."""

    value: str | list
    is_messages: bool
    column: str

    def text(self) -> str:
        """Readable text: the text itself, or one 'role: content' line per message."""
        if not self.is_messages:
            return self.value
        return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in self.value if isinstance(m, dict))

    def excerpt(self, chars: int = EXCERPT_CHARS) -> str:
        t = " ".join(self.text().split())
        return t if len(t) <= chars else t[:chars - 1] + "\u2026"


@dataclass(frozen=True)
class Found:
    """Conversations by id, and a line per input that could not be read (missing, changed)."""

    conversations: dict
    problems: list[str]


def find_conversations(out: ScoredOutput, wanted: set) -> Found:
    """The conversations of the `wanted` ids among `out`'s inputs. An id that names more than one input row (ids
    repeat, or an error row shares a scored row's id) gets none: which row was scored under it cannot be told from
    the id, and an excerpt of the other would put a conversation beside a score that is not its own."""
    spec = read_spec(out.meta.get("read") or {})
    found: dict = {}
    seen: dict[str, int] = {}
    problems: list[str] = []
    keys = {str(w) for w in wanted}
    for rec in out.meta.get("inputs", []):
        path, why = locate(rec, out.path)
        if path is None:
            problems.append(why)
            continue
        try:
            reader = _parquet if path.name.endswith(".parquet") else _jsonl
            for key, conv in reader(path, spec, keys):
                seen[key] = seen.get(key, 0) + 1
                if conv is not None:
                    found.setdefault(key, conv)
        except (InputError, OSError, pa.ArrowException) as e:
            problems.append(f"{path}: could not be read for excerpts ({e})")
    repeated = sorted(k for k, n in seen.items() if n > 1)
    if repeated:
        problems.append(f"{len(repeated)} of the listed ids name more than one input row (e.g. {repeated[0]!r}): "
                        "their conversations are not shown, since which row was scored under the id cannot be told")
    return Found({w: found[str(w)] for w in wanted if str(w) in found and seen[str(w)] == 1}, problems)


def read_spec(read: dict) -> ReadSpec:
    """The reader's settings as the metadata records them."""
    fields = {f.name for f in dataclasses.fields(ReadSpec)}
    kw = {k: (tuple(v) if k == "keep" else v) for k, v in read.items() if k in fields}
    return dataclasses.replace(ReadSpec(**kw), keep=())


def locate(rec: dict, output: Path) -> tuple[Path | None, str]:
    """The input a metadata record names, where it still holds the bytes that were scored."""
    cands = [Path(rec[k]) if k == "abs_path" else output.resolve().parent / rec[k]
             for k in ("abs_path", "rel_path") if rec.get(k)]
    path = next((c for c in cands if c.is_file()), None)
    if path is None:
        return None, f"{rec.get('path')}: not found (looked at {', '.join(map(str, cands))})"
    if rec.get("sha256") is None:
        return None, f"{path}: the output records no sha256 for it (it changed while it was scored)"
    if cached_sha256(path) != rec["sha256"]:
        return None, f"{path}: changed since it was scored (its sha256 differs from the recorded one)"
    return path, ""


def _parquet(path: Path, spec: ReadSpec, keys: set[str]):
    lay = parquet_layout(path, spec)
    columns = [lay.column] + ([lay.id_column] if lay.id_column else [])
    value_set = pa.array(sorted(keys), pa.string())
    row = 0
    for rb in lay.file.iter_batches(batch_size=8192, columns=columns):
        n = rb.num_rows
        ids = rb.column(lay.id_column) if lay.id_column else \
            pa.array([f"{path.name}:{row + i}" for i in range(n)], pa.string())
        row += n
        as_text = ids if pa.types.is_string(ids.type) else pc.cast(ids, pa.string())
        hits = pc.indices_nonzero(pc.is_in(as_text, value_set=value_set))
        if len(hits):
            for key, value in zip(as_text.take(hits).to_pylist(), rb.column(lay.column).take(hits).to_pylist()):
                yield key, None if value is None else Conversation(value, lay.is_messages, lay.column)


def _jsonl(path: Path, spec: ReadSpec, keys: set[str]):
    picked = first_column(path, spec)
    if picked is None:
        return
    column, is_messages = picked
    id_key = spec.id_column or "id"
    for (line_no, obj, _), _size in parsed_lines(path):
        if obj is None:
            continue
        key = as_str(obj.get(id_key, f"{path.name}:{line_no}"))
        if key in keys:
            yield key, None if obj.get(column) is None else Conversation(obj[column], is_messages, column)

