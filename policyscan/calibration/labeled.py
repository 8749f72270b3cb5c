"""Labeled rows for calibrate and evaluate: conversations scored chunk by chunk through the scoring pipeline's
reader, or the f (or p) column and labels of `score --raw` output. Either way, per row only its id, its score and
its raw label are kept."""
from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from policyscan.engine.errors import InputError
from policyscan.engine.files import check_regular
from policyscan.engine.inputs.jsonl import parsed_lines
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.policy.bundle import Policy
from policyscan.engine.run.pipeline import encode_chunk
from policyscan.engine.run.runner import Engine

_FILE, _ROW = "__policyscan_file", "__policyscan_row"  # where a row of read_scores came from
POLICY_COLUMN = "policy"  # in labeled data: the policy a row's label is for (the long layout)


@dataclass(frozen=True)
class Labeled:
    """Rows in input order: id, f (float64) and the label as the file holds it; `column` names the labels. `score`
    says what `f` holds: "f" (the verdict's logit difference) or "p" (a probability read from scores)."""

    ids: list
    f: np.ndarray
    labels: list
    column: str
    score: str = "f"
    others: dict = field(default_factory=dict)  # rows whose `policy` names none of the run's policies: counts
    unverified: tuple = ()  # score files read without policyscan metadata: where their f came from is unknown

    def notes(self, name: str) -> list[str]:
        """Lines to print: rows left out for naming none of the run's policies (a misspelt name shows), and score
        files whose scores could not be traced to the policy."""
        out = []
        if self.others:
            listed = ", ".join(f"{k!r} {n}" for k, n in sorted(self.others.items(), key=lambda kv: -kv[1])[:8])
            out.append(f"{name}: {sum(self.others.values())} labeled rows name no policy of this run in their "
                       f"'policy' column and are left out ({listed})")
        if self.unverified:
            out.append(f"{name}: {', '.join(self.unverified)} holds no score output's metadata (a file made by hand, "
                       "or a review queue), so whether its scores are this policy's (its adapter, prompt and labels) "
                       "cannot be checked")
        return out

    def __post_init__(self) -> None:
        if not len(self.ids) == len(self.f) == len(self.labels):
            raise ValueError(f"{len(self.ids)} ids, {len(self.f)} f values and {len(self.labels)} labels")
        if self.score not in ("f", "p"):
            raise ValueError(f"score {self.score!r}: 'f' or 'p'")


def score_labeled(engine: Engine, files: list[Path], spec: ReadSpec, label_column: str | None) -> Labeled:
    """f of every labeled row under the engine's (first) policy, in bounded memory: each chunk is read, encoded
    and scored as `score` does it (batch invariance: the same f as any other batching). Every labeled row must
    be scored: one that cannot be stops calibrate, naming its file and row."""
    return score_labeled_policies(engine, files, spec, label_column)[0]


def score_labeled_policies(engine: Engine, files: list[Path], spec: ReadSpec,
                           label_column: str | None) -> list[Labeled]:
    """score_labeled for every policy of the engine in one pass: each policy reads its own label column (the one
    given, else `label`, else the policy's name). A file with a `policy` column holds labels per (conversation,
    policy), as `report --review` writes them: each policy keeps only the rows that name it."""
    names = [p.name for p in engine.policies]
    ids: list[list] = [[] for _ in names]
    f: list[list[np.ndarray]] = [[] for _ in names]
    labels: list[list] = [[] for _ in names]
    columns = [label_column or "label"] * len(names)
    others: list[Counter] = [Counter() for _ in names]
    for path in files:
        columns = [label_column or guess_label_column(path, n) for n in names]
        by_policy = POLICY_COLUMN in column_names(path) and POLICY_COLUMN not in columns
        keep = tuple(dict.fromkeys(columns + [POLICY_COLUMN] * by_policy))
        for chunk in read_chunks(path, dataclasses.replace(spec, keep=keep), engine.encoder.render):
            chunk, convs = encode_chunk(engine, chunk)
            for i, reason in enumerate(chunk.errors):
                if reason is not None:
                    raise InputError(f"{path}, row {chunk.first_row + i}: {reason}; fix the labeled data")
            scores = engine.score_conversations(convs)[0].astype(np.float64)
            chunk_ids = chunk.ids.to_pylist()
            owner = chunk.keep[POLICY_COLUMN].to_pylist() if by_policy else None
            for j, (name, column) in enumerate(zip(names, columns)):
                rows = np.arange(len(chunk_ids)) if owner is None else \
                    np.array([k for k, o in enumerate(owner) if o == name], dtype=np.int64)
                if owner is not None:  # names of this run's other policies are theirs, not left out
                    others[j].update("null" if o is None else str(o) for o in owner if o not in names)
                values = chunk.keep[column].to_pylist()
                f[j].append(scores[rows, j])
                ids[j] += [chunk_ids[k] for k in rows]
                labels[j] += [values[k] for k in rows]
    return [Labeled(ids[j], np.concatenate(f[j]) if f[j] else np.zeros(0), labels[j], columns[j],
                    others=dict(others[j])) for j in range(len(names))]


LINES_LOOKED_AT = 4096  # a JSONL file's lines read for its columns: the first object among them names them


def column_names(path: Path) -> list[str]:
    """A labeled file's columns: a Parquet schema's names, the keys of the objects among a JSONL file's first
    LINES_LOOKED_AT lines (a first line without `policy` does not hide the column; blank and malformed lines are the
    reader's row errors). A file that is not a regular file, or cannot be read
    so far, is an InputError naming it."""
    import zlib

    import pyarrow as pa
    import pyarrow.parquet as pq

    check_regular(path)
    try:
        if path.name.endswith(".parquet"):
            return pq.ParquetFile(path).schema_arrow.names
        keys: dict[str, None] = {}
        for n, ((_, obj, _), _) in enumerate(parsed_lines(path)):
            if isinstance(obj, dict):
                keys.update(dict.fromkeys(obj))
            if n + 1 >= LINES_LOOKED_AT:
                break
        if keys:
            return list(keys)
    except (OSError, EOFError, ValueError, zlib.error, pa.ArrowException) as e:
        raise InputError(f"{path}: cannot read its columns ({type(e).__name__}: {e}); is it a Parquet or JSONL file, "
                         "whole?") from e
    raise InputError(f"{path}: no JSON object among its first {LINES_LOOKED_AT} lines, so nothing names its columns; "
                     "a labeled JSONL file holds one object a line")


def guess_label_column(path: Path, policy_name: str) -> str:
    """`label`, else the policy's name, among the file's columns (column_names)."""
    names = column_names(path)
    for guess in ("label", policy_name):
        if guess in names:
            return guess
    raise InputError(f"{path}: no label column ('label' or {policy_name!r}) among {names}; pass --label-column")


def read_scores(files: list[Path], policy: Policy, label_column: str | None,
                prefixes: tuple[str, ...] = ("f",)) -> Labeled:
    """id, the scores and the labels (`label`, else the policy's name) from `score --raw --keep LABEL` outputs (wide
    or long layout): the first of `prefixes` the files hold (f_<name>, or p_<name> for "p"; f, p in the long
    layout). An output whose metadata records the policy with another adapter, prompt or labels is refused: its
    scores are another policy's; a file without metadata is read and named in the notes. Scores that are not
    finite are refused (a NaN would count as a row below every threshold)."""
    import polars as pl

    name = policy.name
    unverified = tuple(str(p) for p in files if not _scores_of(p, policy))
    frames = [(pl.read_parquet(p) if p.name.endswith(".parquet") else pl.read_ndjson(p)).with_columns(
        pl.lit(str(p)).alias(_FILE), pl.int_range(pl.len()).alias(_ROW)) for p in files]
    df = pl.concat(frames, how="diagonal_relaxed")
    col = label_column or ("label" if "label" in df.columns or name not in df.columns else name)
    long = POLICY_COLUMN in df.columns and any(k in df.columns for k in prefixes)  # --layout long
    if long:
        df = df.filter(pl.col(POLICY_COLUMN) == name).rename({k: f"{k}_{name}" for k in prefixes if k in df.columns})
    prefix = next((k for k in prefixes if f"{k}_{name}" in df.columns), prefixes[0])
    for need in ("id", f"{prefix}_{name}", col):
        if need not in df.columns:
            raise InputError(f"{files[0]}: no column {need!r} among {df.columns}; score with --raw "
                             f"--keep {col} to make calibration input")
    scores = df[f"{prefix}_{name}"].cast(pl.Float64).to_numpy()
    if not np.isfinite(scores).all():  # NaN also where a file lacks the column: its rows have no score
        k = int(np.flatnonzero(~np.isfinite(scores))[0])
        column = prefix if long else f"{prefix}_{name}"
        raise InputError(f"{df[_FILE][k]}, row {df[_ROW][k]} (id {df['id'][k]!r}): its {column} is {scores[k]}, not "
                         f"a finite score, as are {int((~np.isfinite(scores)).sum()) - 1} more rows; scores written by "
                         "policyscan are finite")
    return Labeled(df["id"].to_list(), scores, df[col].to_list(), col, prefix, unverified=unverified)


def _scores_of(path: Path, policy: Policy) -> bool:
    """Whether `path`'s metadata traces its scores to `policy` (False: it has none); raises InputError where it
    records the policy with another adapter, prompt or labels, or records no such policy."""
    meta = read_metadata(path)
    if meta is None or "policies" not in meta:  # no metadata, or another command's (a review queue's)
        return False
    name = policy.name
    rec = next((r for r in meta.get("policies") or [] if isinstance(r, dict) and r.get("name") == name), None)
    if rec is None:
        raise InputError(f"{path}: its metadata records no policy {name!r}; its scores are not this policy's: "
                         "give each policy the outputs that scored it")
    kept = set((meta.get("read") or {}).get("keep") or ())
    if hits := sorted(kept & {f"f_{name}", f"p_{name}", "f", "p"}):  # before --keep refused them
        raise InputError(f"{path}: its column {hits[0]!r} is an input column kept with --keep, not policyscan's "
                         "scores; score the labeled data again")
    was = [rec.get("adapter_sha256"), rec.get("prefix"), rec.get("suffix"), rec.get("labels")]
    now = [policy.adapter_sha256, policy.prefix, policy.suffix, [policy.compliant, policy.violation]]
    for what, a, b in zip(("adapter", "prompt prefix", "prompt suffix", "labels"), was, now):
        if a != b:
            raise InputError(f"{path}: scored with another {what} of policy {name!r} than {policy.path} holds "
                             "now; its scores are not this policy's: score the labeled data again")
    return True


@dataclass(frozen=True)
class Split:
    """The rows with a usable label: f, y (True: violation), the held-out rows (by id), the rows the fit uses and
    those the metrics report on: the held-out ones, or every row when the holdout leaves either side empty."""

    f: np.ndarray
    y: np.ndarray
    hold: np.ndarray
    fit: np.ndarray
    report: np.ndarray
    held_out: bool

    def __post_init__(self) -> None:
        if not len(self.f) == len(self.y) == len(self.hold) == len(self.fit) == len(self.report):
            raise ValueError("f, y and the row masks must have one length")


def split_holdout(data: Labeled, y: list[int | None], share: float) -> Split:
    """Rows whose label parsed (y from labels.parse_labels), held out where id_fraction(id) < share."""
    ok = np.array([v is not None for v in y], dtype=bool)
    hold = np.array([id_fraction(i) < share for i, k in zip(data.ids, ok) if k], dtype=bool)
    both = bool(hold.any() and (~hold).any())
    return Split(data.f[ok], np.array([v for v in y if v is not None], dtype=bool), hold,
                 ~hold if both else np.ones_like(hold), hold if both else np.ones_like(hold), both)


def id_fraction(id_) -> float:
    """A fixed number in [0, 1) per id: the same rows are held out on every run."""
    return int.from_bytes(hashlib.sha256(str(id_).encode()).digest()[:8], "big") / 2.0 ** 64
