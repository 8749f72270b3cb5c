"""The score outputs a report reads: found on the command line (files, folders, globs), each checked to be a
finished policyscan output (its metadata), and checked together: outputs of different models or policies are
refused, never mixed into one set of figures."""
from __future__ import annotations

import glob
import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.errors import InputError
from policyscan.engine.files import not_regular
from policyscan.engine.outputs.sinks import META_KEY, is_errors_file, meta_path, read_metadata

OUTPUT_NAMES = (".scores.parquet", ".scores.jsonl", ".scores.jsonl.gz")  # what `score -o DIR/` names its outputs
FORMATS = (".parquet", ".jsonl", ".jsonl.gz")


@dataclass(frozen=True)
class ScoredOutput:
    """A finished output: its path, metadata, layout, policies in column order, and their thresholds."""

    path: Path
    meta: dict
    layout: str
    policies: tuple[str, ...]
    thresholds: tuple[float, ...]
    raw: bool

    def __post_init__(self) -> None:
        if len(self.policies) != len(self.thresholds) or not self.policies:
            raise ValueError(f"{self.path}: {len(self.policies)} policies and {len(self.thresholds)} thresholds")


def find_outputs(items: list[str]) -> list[Path]:
    """Files as named; in folders, the files named as `score -o DIR/` names its outputs; globs. Each file once."""
    out: list[Path] = []
    seen: set[Path] = set()
    for item in items:
        p = Path(item)
        if p.is_dir():
            found = sorted(f for f in p.rglob("*") if f.name.endswith(OUTPUT_NAMES) and f.is_file())
            if not found:
                raise InputError(f"{p}: folder holds no score outputs ({', '.join('*' + s for s in OUTPUT_NAMES)})")
        elif os.path.lexists(p):
            found = [p]
        elif any(c in item for c in "*?["):
            found = sorted(Path(f) for f in glob.glob(item, recursive=True) if Path(f).is_file())
            if not found:
                raise InputError(f"{item}: the pattern matches no file")
        else:
            raise InputError(f"{item}: no such file or folder")
        for f in found:
            if f.resolve() not in seen:
                seen.add(f.resolve())
                out.append(f)
    return out


def open_output(path: Path) -> ScoredOutput:
    """The output at `path` with its metadata; anything else is refused saying what it is."""
    if (what := not_regular(path)) is not None:
        raise InputError(f"{path}: {what}; name a score output")
    if not path.name.endswith(FORMATS):
        raise InputError(f"{path}: not a score output (policyscan writes .parquet, .jsonl or .jsonl.gz)")
    meta = read_metadata(path)
    if meta is None:
        raise InputError(f"{path}: {_what_it_is(path)}, without policyscan metadata: not an output of `policyscan "
                         "score`; name the outputs score wrote")
    if "policies" not in meta or "accounting" not in meta:
        raise InputError(f"{path}: its policyscan metadata has no policies or accounting; is it from an older "
                         "policyscan? score it again")
    policies = tuple(p["name"] for p in meta["policies"])
    out = meta.get("output") or {}
    return ScoredOutput(path, meta, out.get("layout", "wide"), policies,
                        tuple(float(p.get("threshold", 0.5)) for p in meta["policies"]), bool(out.get("raw")))


def _what_it_is(path: Path) -> str:
    if path.name.endswith(".parquet"):
        try:
            pf = pq.ParquetFile(path)
        except (OSError, pa.ArrowException) as e:
            return f"not a readable Parquet file ({e})"
        kv = pf.metadata.metadata or {}
        return (f"a Parquet file of {pf.metadata.num_rows:,} rows with columns {pf.schema_arrow.names}"
                + ("" if META_KEY not in kv else " whose policyscan metadata cannot be read"))
    if is_errors_file(path):
        return "a policyscan errors file (the rows a run could not score)"
    if not meta_path(path).exists():
        return f"a JSONL file with no {meta_path(path).name} beside it"
    return f"a JSONL file whose {meta_path(path).name} cannot be read"


def identity(out: ScoredOutput) -> dict:
    """What decides an output's p: the model's hash, and each policy's adapter, prompt, labels, calibration and
    threshold. Outputs reported together must agree on it."""
    return {"model": out.meta.get("model", {}).get("sha256"),
            "policies": [{"name": p["name"], "adapter_sha256": p.get("adapter_sha256"), "prefix": p.get("prefix"),
                          "suffix": p.get("suffix"), "labels": p.get("labels"),
                          "a": (p.get("calibration") or {}).get("a"), "b": (p.get("calibration") or {}).get("b"),
                          "threshold": p.get("threshold")} for p in out.meta["policies"]]}


def check_together(outputs: list[ScoredOutput]) -> None:
    """One model and one set of policies (name, adapter, prompt, calibration, threshold) across the outputs, and no
    input scored into two of them (a copied output, or one written flat and again in its folder): its rows would
    count twice."""
    first = identity(outputs[0])
    for out in outputs[1:]:
        other = identity(out)
        if other == first:
            continue
        why = _difference(first, other)
        raise InputError(f"{outputs[0].path} and {out.path} were scored {why}; their figures would mix: report "
                         "them apart (one `policyscan report` for each model and set of policies)")
    seen: dict[tuple, ScoredOutput] = {}
    for out in outputs:
        for rec in out.meta.get("inputs", []):
            key = (rec.get("sha256"), rec.get("abs_path") or rec.get("path"))  # two files of equal bytes are two
            if key[0] is not None and seen.setdefault(key, out) is not out:
                raise InputError(f"{seen[key].path} and {out.path} both hold the rows of input {key[1]} (sha256 "
                                 f"{key[0][:12]}...); its rows would count twice: report one of them")


def _difference(a: dict, b: dict) -> str:
    if a["model"] != b["model"]:
        return f"by different models (sha256 {str(a['model'])[:12]}... and {str(b['model'])[:12]}...)"
    names_a, names_b = [p["name"] for p in a["policies"]], [p["name"] for p in b["policies"]]
    if names_a != names_b:
        return f"with different policies ({', '.join(names_a)} and {', '.join(names_b)})"
    for pa_, pb_ in zip(a["policies"], b["policies"]):
        for key in ("adapter_sha256", "prefix", "suffix", "labels", "a", "b", "threshold"):
            if pa_[key] != pb_[key]:
                what = {"a": "calibration a", "b": "calibration b"}.get(key, key)
                return f"with different versions of policy {pa_['name']!r} ({what}: {pa_[key]!r} and {pb_[key]!r})"
    return "differently"
