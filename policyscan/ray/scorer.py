"""PolicyScorer: the engine as a callable class for Ray Data's map_batches, pyarrow batches in and out.

    ds.map_batches(PolicyScorer, fn_constructor_kwargs={"model": DIR, "policies": [BUNDLE, ...]},
                   compute=ray.data.ActorPoolStrategy(size=N), num_gpus=1, batch_size=4096, batch_format="pyarrow")

A batch is scored as the single-process pipeline scores a chunk (pipeline.encode_chunk, pipeline.score_chunk on
the same Engine), so p and f are bitwise those of `policyscan score` with the same settings on the same kind of
device. Every input row comes out, in input order: scored, or with `error` saying why it was not."""
from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from policyscan.engine.errors import InputError
from policyscan.engine.inputs.rows import Chunk, ReadSpec, clip, clip_chars, conversation, pick_column
from policyscan.engine.outputs.accounting import Accounting
from policyscan.engine.outputs.columns import check_keep
from policyscan.engine.parallel.workers_proc import Recorder
from policyscan.engine.policy.bundle import Policy, load_policies
from policyscan.engine.run.pipeline import encode_chunk, score_chunk
from policyscan.engine.settings import EngineSettings
from policyscan.ray.read import SOURCE

_WHERE = Path("a Ray batch")  # what the column errors name in place of a file


def scorer_columns(names: list[str], raw: bool, truncation: bool, provenance: bool) -> dict[str, str]:
    """The columns PolicyScorer adds beside `id` and the kept ones, each with what adds it (sinks.check_keep's
    form): a kept column of one of these names would be replaced by it."""
    cols = {f"p_{n}": f"the probability of policy {n!r}" for n in names}
    cols.update({f"f_{n}": "raw" for n in names if raw})
    cols.update({f"truncated_{n}": "truncation" for n in names if truncation})
    cols.update({c: "PolicyScorer" for c in ("prompt_tokens", "clipped", "error")})
    return {**cols, **({"provenance": "provenance"} if provenance else {})}


class PolicyScorer:
    """model: a model directory; policies: bundles (or folders of them), or loaded Policy objects; settings: an
    EngineSettings or its fields as a dict (device "auto" takes the GPU Ray gives the actor).

    The conversation is `text_column` or `messages_column` (else guessed as `score` guesses: text,
    conversation, transcript, messages, turns); the id is `id_column` (default: `id` when the batch has one), else
    `<file name>:<row>` from `path_column` (read_parquet(include_paths=True) adds `path`) and `row_column`, which
    the batch must then hold (Ray Data gives no row numbers: add them where the data is made, or read the files
    with policyscan.ray.read_units). A row whose `error_column` is set is not scored: that is its error.

    Returns, per input row in order: `id`, the `keep` columns, `p_<policy>` (and `f_<policy>` with raw,
    `truncated_<policy>` with truncation: the prompt lost the conversation's oldest tokens), `prompt_tokens`,
    `clipped` (the text was longer than max_chars and kept its tail) and `error` (null when scored; p and f are null
    when not, truncated when the row's prompts were not run). provenance adds `provenance` on each batch's first
    row: the JSON of Engine.describe() and the model's file hashes, which `score --ray` records in its outputs'
    metadata."""

    def __init__(self, model: str | Path, policies: Sequence[str | Path | Policy],
                 settings: EngineSettings | dict | None = None, *, text_column: str | None = None,
                 messages_column: str | None = None, id_column: str | None = None, path_column: str = "path",
                 row_column: str = "row", error_column: str | None = None, keep: Sequence[str] = (),
                 raw: bool = False, truncation: bool = False, max_chars: int | None = None,
                 provenance: bool = False, checked: bool = False):
        if isinstance(settings, dict):
            settings = EngineSettings(**settings)
        settings = settings or EngineSettings()
        loaded = sum(isinstance(p, Policy) for p in policies)
        if loaded not in (0, len(policies)):
            raise InputError("PolicyScorer: give policies as bundle paths or as Policy objects, not both")
        pols = list(policies) if loaded else load_policies(list(policies))
        check_keep([k for k in keep if k != SOURCE], id_column,
                   scorer_columns([p.name for p in pols], raw, truncation, provenance))
        self.spec = ReadSpec(text_column, messages_column, id_column, tuple(keep),
                             max_chars=max_chars or clip_chars(settings.max_length))
        self.path_column, self.row_column, self.error_column = path_column, row_column, error_column
        self.raw, self.truncation, self.provenance = raw, truncation, provenance
        self.checked = checked  # texts already checked and rendered by policyscan's readers (score --ray)
        from policyscan.engine.run.runner import Engine  # torch: in the actor; the driver and the read tasks go without

        self.engine = Engine(Path(model), pols, settings)
        self.names = [p.name for p in self.engine.policies]
        self.budgets = np.array([b.budget for b in self.engine.builders], dtype=np.int64)

    def __call__(self, batch: pa.Table | pa.RecordBatch) -> pa.Table:
        batch = pa.table(batch) if isinstance(batch, pa.RecordBatch) else batch
        chunk, clipped = self._chunk(batch)
        chunk, convs = encode_chunk(self.engine, chunk)
        engine_rows = np.flatnonzero([e is None for e in chunk.errors])  # the rows whose prompts are run
        rec = Recorder()
        acc = Accounting(above_threshold={n: 0 for n in self.names})
        score_chunk(self.engine, chunk, convs, rec, rec, acc, strict=False)
        errors: list[str | None] = [None] * len(chunk)
        for _, i, _, _, reason in rec.errors:  # (file, row, line, id, reason); the chunk's row i is batch row i
            errors[i] = reason
        scored = np.array([e is None for e in errors], dtype=bool)
        cols: dict[str, pa.Array] = {"id": chunk.ids, **chunk.keep}
        _, _, p, f, _ = rec.writes[0]
        cols.update({f"p_{n}": _spread(p[:, j], scored) for j, n in enumerate(self.names)})
        if self.raw:
            cols.update({f"f_{n}": _spread(f[:, j], scored) for j, n in enumerate(self.names)})
        tokens, cut = self._prompts(convs, engine_rows, len(chunk), acc)
        if self.truncation:
            ran = np.zeros(len(chunk), dtype=bool)
            ran[engine_rows] = True
            cols.update({f"truncated_{n}": pa.array(cut[:, j], mask=~ran) for j, n in enumerate(self.names)})
        cols["prompt_tokens"] = pa.array(tokens)
        cols["clipped"] = pa.array(clipped)
        cols["error"] = pa.array(errors, pa.string())
        if self.provenance:
            cols["provenance"] = pa.array([self.report() if i == 0 else None for i in range(len(chunk))], pa.string())
        return pa.table(cols)

    def _chunk(self, batch: pa.Table) -> tuple[Chunk, np.ndarray]:
        """The batch as the readers give a chunk (row i is chunk row i), and which texts were clipped."""
        column, is_messages = pick_column(self.spec, batch.column_names, _WHERE)
        upstream = batch.column(self.error_column).to_pylist() if self.error_column else [None] * batch.num_rows
        render = self.engine.encoder.render
        # a checked text is not checked again: the reader's one-past-the-limit tail may be all whitespace
        pairs = [(None, e) if e is not None else (v, None) if self.checked else conversation(v, is_messages, render)
                 for v, e in zip(batch.column(column).to_pylist(), upstream)]
        texts = [t for t, _ in pairs]
        clipped = np.array([t is not None and len(t) > self.spec.max_chars for t in texts], dtype=bool)
        keep = {k: batch.column(k).combine_chunks() for k in self.spec.keep}
        return Chunk("", 0, self._ids(batch), texts, [e for _, e in pairs], None, keep,
                     clip(texts, self.spec.max_chars)), clipped

    def _ids(self, batch: pa.Table) -> pa.Array:
        names = batch.column_names
        id_column = self.spec.id_column or ("id" if "id" in names else None)
        if id_column in names:
            return batch.column(id_column).combine_chunks()
        if id_column is None and self.path_column in names and self.row_column in names:
            paths, rows = batch.column(self.path_column).to_pylist(), batch.column(self.row_column).to_pylist()
            return pa.array([f"{Path(p).name}:{r}" for p, r in zip(paths, rows)], pa.string())
        missing = repr(id_column) if id_column else f"'id', nor {self.path_column!r} and {self.row_column!r}"
        raise InputError(f"{_WHERE}: no column {missing} to take the ids from (it has {names}); pass id_column=, "
                         f"or give each row its file ({self.path_column}) and row number ({self.row_column})")

    def _prompts(self, convs: list[np.ndarray], rows: np.ndarray, n: int,
                 acc: Accounting) -> tuple[np.ndarray, np.ndarray]:
        """Each row's prompt tokens, and [rows, policies] whether its prompt was cut, as Engine.score_conversations
        counts them (checked against its totals)."""
        conv_len = np.array([len(c) for c in convs], dtype=np.int64)
        fixed = np.array([b.max_length - b.budget for b in self.engine.builders], dtype=np.int64)
        tokens, cut = np.zeros(n, dtype=np.int64), np.zeros((n, len(self.names)), dtype=bool)
        tokens[rows] = (fixed[None, :] + np.minimum(conv_len[:, None], self.budgets[None, :])).sum(axis=1)
        cut[rows] = conv_len[:, None] > self.budgets[None, :]
        if tokens.sum() != acc.prompt_tokens or cut.sum() != acc.truncated_prompts:
            raise RuntimeError(f"per-row prompt counts ({tokens.sum()} tokens, {cut.sum()} cut) differ from the "
                               f"engine's ({acc.prompt_tokens}, {acc.truncated_prompts}); PolicyScorer._prompts "
                               "no longer counts as Engine.score_conversations does")
        return tokens, cut

    def report(self) -> str:
        """What `score --ray` records of this actor: Engine.describe() and the model's file hashes, as JSON."""
        return json.dumps({"describe": self.engine.describe(), "model_files": self.engine.checkpoint.file_hashes()},
                          sort_keys=True, default=str)


def _spread(values: np.ndarray, scored: np.ndarray) -> pa.Array:
    """A scored rows' column over every row: null where the row was not scored."""
    full = np.zeros(len(scored), dtype=values.dtype)
    full[scored] = values
    return pa.array(full, mask=~scored)
