"""What every reader shares: the read settings, a chunk of rows, and the checks that turn one cell into a
conversation text or the reason it cannot be scored."""
from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa

from policyscan.engine.errors import InputError

TEXT_GUESSES = ("text", "conversation", "transcript")
MESSAGES_GUESSES = ("messages", "conversation", "turns")
_SURROGATE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class ReadSpec:
    text_column: str | None = None
    messages_column: str | None = None
    id_column: str | None = None
    keep: tuple[str, ...] = ()
    chunk_rows: int = 4096
    chunk_chars: int = 16 << 20  # a JSONL chunk also ends at this much text: huge rows keep memory bounded
    max_chars: int = 1 << 20  # a conversation longer than this keeps its tail (tokens are cut from the left anyway)

    def __post_init__(self) -> None:
        if self.text_column and self.messages_column:
            raise InputError("give --text-column or --messages-column, not both")


@dataclass
class Chunk:
    """Consecutive rows of one file. texts[i] is None exactly when errors[i] says why."""

    path: str
    first_row: int
    ids: pa.Array  # the id column as stored (Parquet), strings (JSONL), or "file:row" when there is none
    texts: list[str | None]
    errors: list[str | None]
    lines: list[int] | None = None  # 1-based line numbers (JSONL)
    keep: dict[str, pa.Array] = field(default_factory=dict)
    clipped: int = 0  # conversations longer than max_chars, kept from the tail

    def __len__(self) -> int:
        return len(self.errors)


class PartialFileError(InputError):
    """A file that broke after `done` of its `total` rows were delivered."""

    def __init__(self, message: str, done: int, total: int | None):
        super().__init__(message)
        self.done, self.total = done, total


def conversation_candidates(columns) -> list[str]:
    """The column names, among `columns`, that are taken for the conversation when none is named."""
    return [g for g in dict.fromkeys(TEXT_GUESSES + MESSAGES_GUESSES) if g in columns]


def pick_column(spec: ReadSpec, columns: list[str], path: Path, where: str = "") -> tuple[str, bool]:
    """(column, is_messages) from the spec, or guessed from the names present (`where` says whose names)."""
    if spec.text_column or spec.messages_column:
        col = spec.text_column or spec.messages_column
        if col not in columns:
            raise InputError(f"{path}: no column {col!r}; it has {columns}")
        return col, spec.messages_column is not None
    found = conversation_candidates(columns)
    if len(found) > 1:  # two candidates may disagree about a row: choosing one would be a guess
        raise InputError(f"{path}: columns {found} could each be the conversation{where}; name one with "
                         "--text-column or --messages-column")
    if found:
        return found[0], found[0] in MESSAGES_GUESSES and found[0] not in TEXT_GUESSES
    raise InputError(f"{path}: no conversation column found among {columns}{where}; "
                     "name it with --text-column or --messages-column")


def conversation(value, is_messages: bool, render: Callable[[str | list], str]) -> tuple[str | None, str | None]:
    """(text, None) or (None, reason): one cell of the conversation column checked, then made the text the encoder
    reads by `render` (content.Conversations: messages rendered, content marked so that it stays text)."""
    if value is None:
        return None, "null conversation"
    if is_messages:
        if isinstance(value, str):
            return None, "messages column holds a string, expected a list of {role, content}"
        if not isinstance(value, list) or not value:
            return None, f"messages must be a non-empty list of {{role, content}}, got {type(value).__name__}"
        for j, m in enumerate(value):
            if (why := message_problem(m)) is not None:
                return None, f"message {j} {why}: {str(m)[:80]!r}"
        try:
            value = render(value)
        except Exception as e:  # a template error is about this row, not the run
            return None, f"chat template failed: {printable(str(e))}"
    elif not isinstance(value, str):
        return None, f"conversation is {type(value).__name__}, expected a string"
    if (bad := surrogate(value)) is not None:
        return None, f"the conversation {bad}"
    if not value.strip():
        return None, "empty conversation"
    return value if is_messages else render(value), None


def message_problem(m) -> str | None:
    """Why a message cannot be rendered, or None. Its role is a string; its content a string, a list of text parts
    ({type: "text", text: str}, as OpenAI and Gemma 3 write them), or null beside tool calls (OpenAI's shape for an
    assistant turn that only calls tools)."""
    if not isinstance(m, dict) or not isinstance(m.get("role"), str):
        return "is not a {role: str, content: str} object"
    content = m.get("content")
    if isinstance(content, str):
        return None
    if content is None:
        return None if m.get("tool_calls") else "has no content (null content is taken beside tool_calls only)"
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
        return None
    return ("has content that is neither a string nor a list of text parts ({type: 'text', text: str}); other parts "
            "(images, audio) cannot be scored")


def surrogate(s: str) -> str | None:
    """Why `s` cannot be encoded (a lone surrogate, which JSON's \\ud800 escapes can make), or None."""
    m = None if s.isascii() else _SURROGATE.search(s)  # isascii is O(1): most strings skip the search
    if m is None:
        return None
    return (f"holds a lone surrogate \\u{ord(m.group()):04x} at character {m.start()}, which is not valid "
            "Unicode; fix the program that wrote this file")


def printable(s: str) -> str:
    """`s` with lone surrogates written as \\udXXX escapes, so that it can be written anywhere."""
    return s.encode("utf-8", "backslashreplace").decode("utf-8")


def as_str(v) -> str | None:
    """JSON values have no fixed type across lines; ids and kept fields become strings (JSON for non-strings)."""
    return v if v is None or isinstance(v, str) else json.dumps(v)


def json_id(v: object, key: str) -> tuple[str | None, str | None]:
    """(the id as text, None) or (its text, why it cannot name the row): a JSON id must be a string or an integer.
    A null names no row; a float, true or false, a list or an object would be named by a text that other tools
    write differently (1.5 against 1.50, True against true)."""
    if isinstance(v, str):
        return v, None
    if isinstance(v, int) and not isinstance(v, bool):
        return str(v), None
    if v is None:
        return None, f"null id (field {key!r}); give every row an id, or name another field with --id-column"
    kind = {bool: f"is {as_str(v)}", float: "has a fraction or an exponent", list: "is a list", dict: "is an object"}
    return as_str(v), f"the id (field {key!r}) {kind[type(v)]}; ids must be strings or integers"


def id_type_error(t: pa.DataType, col: str) -> str | None:
    """Why a Parquet id column's type cannot hold ids, or None: strings or integers, as JSON ids (decimals of scale 0
    are integers: Snowflake's and Spark's NUMBER(38, 0) keys)."""
    values = t.value_type if pa.types.is_dictionary(t) else t
    if (pa.types.is_string(values) or pa.types.is_large_string(values) or pa.types.is_string_view(values)
            or pa.types.is_integer(values) or (pa.types.is_decimal(values) and values.scale == 0)):
        return None
    return f"id column {col!r} has type {t}; ids must be strings or integers: name another column with --id-column"


def clip(texts: list[str | None], limit: int) -> int:
    """Keep the tail of texts longer than `limit`; how many were cut."""
    n = 0
    for i, t in enumerate(texts):
        if t is not None and len(t) > limit:
            texts[i], n = t[-limit:], n + 1
    return n


def clip_chars(max_length: int) -> int:
    """Conversations longer than this many characters keep only their tail before tokenizing: 64 characters
    a token is far more than byte-level BPE ever averages, so the tokens kept after left truncation are the
    same, and a row of any size costs no more than one of that length."""
    return max(64 * max_length, 65536)
