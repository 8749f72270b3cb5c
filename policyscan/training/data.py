"""Labeled rows as prompts: read, rendered, encoded and truncated by the very code `score` uses (TextEncoder,
PromptBuilder, encode_chunk), so that a policy trains on the ids it will be scored on."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from policyscan.calibration.labeled import POLICY_COLUMN, column_names, guess_label_column, id_fraction
from policyscan.calibration.labels import parse_labels
from policyscan.engine.errors import InputError
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.outputs.sinks import ErrorWriter
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.run.pipeline import encode_chunk
from policyscan.engine.text.prompts import PolicyPrompts


@dataclass(frozen=True)
class Example:
    """One labeled row: its id, the prompt's token ids, the label (1: violation) and where it came from."""

    id: object
    ids: tuple[int, ...]
    label: int
    truncated: bool
    where: str  # "file, row N"


@dataclass
class Examples:
    """The rows that train and the held-out rows, and the row accounting of what was read."""

    train: list[Example] = field(default_factory=list)
    holdout: list[Example] = field(default_factory=list)
    read: int = 0
    errors: int = 0
    others: int = 0  # rows of a review queue that label another policy
    label_column: str | None = None

    def counts(self) -> dict:
        def per_class(rows: list[Example]) -> dict:
            pos = sum(e.label for e in rows)
            return {"violation": pos, "compliant": len(rows) - pos}
        return {"read": self.read, "errors": self.errors, "other_policies": self.others,
                "train": per_class(self.train), "holdout": per_class(self.holdout)}

    def check_balanced(self) -> None:
        if self.read != len(self.train) + len(self.holdout) + self.errors + self.others:
            raise AssertionError(f"row accounting: {self.read} read, {len(self.train)} train, {len(self.holdout)} "
                                 f"holdout, {self.errors} errors")


def read_examples(prompts: PolicyPrompts, policy: Policy, files: list[Path], spec: ReadSpec,
                  label_column: str | None, holdout: float, errors: ErrorWriter) -> Examples:
    """Every row of the labeled files, in bounded chunks: a row that cannot be encoded, or whose label is not one
    calibrate reads, goes to `errors` with its file, row and reason; the others are split by a hash of their id
    (calibration.labeled.id_fraction: the rows calibrate would hold out). A file with a `policy` column (a
    review queue) gives only the rows that name this policy."""
    builder = prompts.builders[0]
    out = Examples()
    for path in files:
        column = label_column or guess_label_column(path, policy.name)
        if out.label_column not in (None, column):
            raise InputError(f"{path}: its labels are in column {column!r}, the files before it in "
                             f"{out.label_column!r}; pass --label-column")
        out.label_column = column
        by_policy = column != POLICY_COLUMN and POLICY_COLUMN in column_names(path)  # `report --review`'s queue
        keep = (column, POLICY_COLUMN) if by_policy else (column,)
        for chunk in read_chunks(path, _keeping(spec, keep), prompts.encoder.render):
            out.read += len(chunk)
            if column not in chunk.keep:
                raise InputError(f"{path}: no column {column!r}; pass --label-column")
            chunk, convs = encode_chunk(prompts, chunk)
            labels, bad = parse_labels(chunk.keep[column].to_pylist(), policy.compliant, policy.violation)
            reasons = list(chunk.errors)
            for i, why in bad:
                reasons[i] = reasons[i] or f"column {column!r}: {why}"
            ids, conv = chunk.ids.to_pylist(), iter(convs)
            owner = chunk.keep[POLICY_COLUMN].to_pylist() if by_policy else None
            for i, reason in enumerate(reasons):
                encoded = next(conv) if chunk.errors[i] is None else None
                if owner is not None and owner[i] != policy.name:
                    out.others += 1
                    continue
                if reason is not None:
                    line = chunk.lines[i] if chunk.lines else None
                    errors.add(str(path), chunk.first_row + i, line, ids[i], reason)
                    out.errors += 1
                    continue
                prompt, cut = builder.build(np.asarray(encoded))
                example = Example(ids[i], tuple(int(t) for t in prompt), int(labels[i]), cut,
                                  f"{path}, row {chunk.first_row + i}")
                (out.holdout if id_fraction(ids[i]) < holdout else out.train).append(example)
    out.check_balanced()
    return out


def _keeping(spec: ReadSpec, columns: tuple[str, ...]) -> ReadSpec:
    return replace(spec, keep=tuple(dict.fromkeys((*spec.keep, *columns))))
