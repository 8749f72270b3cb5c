"""An output's errors file summarized by reason: reasons that differ only in a path, a number or a quoted value
count as one, each with its first example; read line by line, with a bounded number of reasons."""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from policyscan.engine.outputs.sinks import LINE_LIMIT, is_errors_file

MAX_REASONS = 200  # distinct reasons kept; the rest are counted as "other reasons"
OTHER = "other reasons"
_QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"")
_NUMBER = re.compile(r"\d+(?:\.\d+)?")


def reason_kind(reason: str, file: str | None) -> str:
    """A reason without what is particular to its row: the file's name, quoted values and numbers."""
    text = str(reason)
    if file and text.startswith(f"{file}"):
        text = text[len(file):].lstrip(":, ")
    return _NUMBER.sub("N", _QUOTED.sub("'...'", text))[:200]


@dataclass
class ErrorSummary:
    """Rows listed per kind of reason, with the first example of each, over every errors file read."""

    counts: Counter = field(default_factory=Counter)
    examples: dict[str, dict] = field(default_factory=dict)
    files_read: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)  # errors files the metadata names that are not there

    def read(self, path: Path) -> None:
        """One errors file, line by line."""
        if not is_errors_file(path):
            self.missing.append(str(path))
            return
        self.files_read.append(str(path))
        with open(path, "rb") as fh:
            while line := fh.readline(LINE_LIMIT):
                rec = json.loads(line)
                kind = reason_kind(rec.get("reason", ""), rec.get("file"))
                if kind not in self.counts and len(self.counts) >= MAX_REASONS:
                    kind = OTHER
                self.counts[kind] += 1
                self.examples.setdefault(kind, rec)

    @property
    def rows(self) -> int:
        return sum(self.counts.values())


def errors_file(output: Path, meta: dict) -> Path | None:
    """Where an output's errors file is: as the metadata names it (relative to the output's folder when that name
    is not found from here), else beside the output; None when the run listed no errors."""
    named = meta.get("errors_file")
    if not named:
        return None
    for cand in (Path(named), output.parent / Path(named).name, output.with_name(output.name + ".errors.jsonl")):
        if cand.is_file():
            return cand
    return Path(named)
