"""What a run accounts for: the output's settings, the row accounting that always balances, and the rows and files
that go to the errors file instead of the output."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.rows import Chunk, PartialFileError
from policyscan.engine.outputs.sinks import ErrorWriter


@dataclass(frozen=True)
class OutputSpec:
    fmt: str = "parquet"
    layout: str = "wide"
    raw: bool = False
    strict: bool = False
    flagged: bool = False     # flagged_<policy> = p >= the policy's threshold
    truncation: bool = False  # `truncated`: the prompt lost the conversation's oldest tokens

    def __post_init__(self) -> None:
        if self.fmt not in ("parquet", "jsonl"):
            raise InputError(f"--format must be parquet or jsonl, got {self.fmt!r}")
        if self.layout not in ("wide", "long"):
            raise InputError(f"--layout must be wide or long, got {self.layout!r}")


@dataclass
class Accounting:
    rows_in: int = 0
    rows_scored: int = 0
    rows_in_errors: int = 0
    files_in_errors: int = 0
    prompt_tokens: int = 0
    truncated_prompts: int = 0
    clipped_conversations: int = 0
    seconds: float = 0.0          # the whole scoring window, of which:
    input_wait_seconds: float = 0.0  # waiting for the reader: reading and tokenizing the GPU did not hide
    output_seconds: float = 0.0      # calibrating and writing
    duplicate_ids: int = 0  # scored rows whose id an earlier row of the same output already has
    above_threshold: dict[str, int] = field(default_factory=dict)

    def add(self, other: "Accounting") -> None:
        for k, v in asdict(other).items():
            if k == "above_threshold":
                for name, n in v.items():
                    self.above_threshold[name] = self.above_threshold.get(name, 0) + n
            else:
                setattr(self, k, getattr(self, k) + v)

    @property
    def balanced(self) -> bool:
        return self.rows_in == self.rows_scored + self.rows_in_errors


class StrictStop(InputError):
    """--strict: the first row that cannot be scored ends the run."""


@dataclass(frozen=True)
class FileFailure:
    """A file that could not be read (whole, or from row `done` on): accounted by the consumer."""

    path: Path
    error: InputError
    done: int


def file_failure(ff: FileFailure, err: ErrorWriter, acc: Accounting, strict: bool) -> None:
    if strict:
        raise StrictStop(str(ff.error)) from ff.error
    acc.files_in_errors += 1
    total = ff.error.total if isinstance(ff.error, PartialFileError) else None
    lost = 0 if total is None else total - ff.done
    if lost:  # rows the Parquet footer promises but that could not be read: each one accounted
        acc.rows_in += lost
        acc.rows_in_errors += lost
        for r in range(ff.done, total):
            err.add(str(ff.path), r, None, None, str(ff.error))
    else:
        err.add(str(ff.path), None, None, None, str(ff.error))


def row_error(chunk: Chunk, i: int, reason: str, err: ErrorWriter, strict: bool) -> None:
    line = chunk.lines[i] if chunk.lines else None
    if strict:
        where = f"line {line}" if line else f"row {chunk.first_row + i}"
        raise StrictStop(f"{chunk.path}, {where}: {reason} (--strict stops at the first bad row)")
    err.add(chunk.path, chunk.first_row + i, line, chunk.ids[i].as_py(), reason)
