"""JSON whose objects name each key once.

Python's json keeps the last of two values under one key, and another reader may keep the first, so a line or a
file that says `"role": "user"` and `"role": "system"` in one object means different things to different tools. Such
JSON is refused here, naming the key, wherever policyscan reads JSON it was given (input lines, config and policy
files)."""
from __future__ import annotations

import json


class DuplicateKeyError(ValueError):
    """An object names `key` twice."""

    def __init__(self, key: str):
        super().__init__(f"the key {key!r} appears twice in one object, so which value is meant cannot be told")
        self.key = key


def _object(pairs: list[tuple[str, object]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        for k, _ in pairs:
            if k in seen:
                raise DuplicateKeyError(k)
            seen.add(k)
    return obj


_DECODER = json.JSONDecoder(object_pairs_hook=_object)


def loads(text: str | bytes) -> object:
    """json.loads, except that an object naming a key twice raises DuplicateKeyError (a ValueError, as
    json.JSONDecodeError is). Bytes are decoded as json.loads decodes them (UTF-8, -16 or -32, by their start)."""
    if isinstance(text, (bytes, bytearray)):
        text = bytes(text).decode(json.detect_encoding(text), "surrogatepass")
    elif text.startswith("\ufeff"):
        raise json.JSONDecodeError("Unexpected UTF-8 BOM (decode using utf-8-sig)", text, 0)
    return _DECODER.decode(text)
