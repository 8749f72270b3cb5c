"""policyscan verify OUTPUT: re-score a sample of an output's rows as its metadata says, compare bit for bit."""
from __future__ import annotations

import dataclasses
import hashlib
import sys
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq

from ..engine.checkpoint import file_sha256
from ..engine.errors import InputError, PolicyscanError
from ..engine.policy import load_policy
from ..engine.runner import Engine, EngineSettings
from ..engine.sinks import read_metadata
from ..engine.sources import ReadSpec, read_chunks
from .common import friendly_errors

EXIT_DIFFERS = 4


@click.command()
@click.argument("output", type=click.Path(exists=True, dir_okay=False))
@click.option("--sample", default=64, show_default=True, type=click.IntRange(1), help="rows to re-score")
@click.option("--device", default=None, help="override the recorded device (results may then differ)")
@friendly_errors
def verify(output: str, sample: int, device: str | None) -> None:
    """Re-score SAMPLE rows of OUTPUT with the model, policies and settings its metadata records.

    Exit status: 0 every sampled row reproduced bit for bit, 4 some differ, 1 the run cannot be repeated
    (a model, adapter or input changed or is missing)."""
    out = Path(output)
    meta = read_metadata(out)
    if meta is None:
        raise PolicyscanError(f"{out}: no policyscan metadata; only `policyscan score` outputs can be verified")
    _check_hashes(meta)
    policies = []
    for rec in meta["policies"]:
        cal = rec["calibration"]
        policies.append(dataclasses.replace(load_policy(rec["path"]), a=cal["a"], b=cal["b"]))
    s = meta["settings"]
    engine = Engine(meta["model"]["path"], policies,
                    EngineSettings(device or str(meta["device"]).split(":")[0], meta["precision"],
                                   s["batch_tokens"], s["max_length"], cuda_graphs=s.get("cuda_graphs", True)))
    stored = _stored(out, meta, [p.name for p in policies])
    ids = sorted(stored, key=lambda i: hashlib.sha256(str(i).encode()).digest())[:sample]
    texts = _find(meta, set(ids), engine)
    missing = [i for i in ids if i not in texts]
    if missing:
        raise InputError(f"{len(missing)} sampled ids not found in the recorded inputs, e.g. {missing[0]!r}")
    convs = [np.asarray(x, dtype=np.int64) for x in engine.encoder.encode_batch([texts[i] for i in ids])]
    f, _, _ = engine.score_conversations(convs)
    bad = []
    for r, i in enumerate(ids):
        for j, pol in enumerate(policies):
            p = float(pol.calibrate_np(f[r:r + 1, j])[0])
            if p != stored[i][pol.name]:
                bad.append((i, pol.name, stored[i][pol.name], p))
    click.echo(f"verified {len(ids)} rows x {len(policies)} policies of {out}: "
               f"{'all reproduced bit for bit' if not bad else f'{len(bad)} differ'}")
    for i, name, want, got in bad[:10]:
        click.echo(f"  id {i!r} {name}: stored {want!r}, now {got!r}")
    sys.exit(EXIT_DIFFERS if bad else 0)


def _check_hashes(meta: dict) -> None:
    for rec in meta["policies"]:
        path = Path(rec["path"]) / "adapter_model.safetensors"
        if not path.is_file() or file_sha256(path) != rec["adapter_sha256"]:
            raise PolicyscanError(f"policy {rec['name']!r}: {path} is missing or changed since the run")
    for rec in meta["inputs"]:
        if not Path(rec["path"]).is_file() or file_sha256(Path(rec["path"])) != rec["sha256"]:
            raise PolicyscanError(f"input {rec['path']} is missing or changed since the run")


def _stored(out: Path, meta: dict, names: list[str]) -> dict:
    """id -> {policy: p} from a wide or long output."""
    if out.name.endswith(".parquet"):
        cols = ["id", "policy", "p"] if meta["output"]["layout"] == "long" else ["id"] + [f"p_{n}" for n in names]
        rows = pq.read_table(out, columns=cols).to_pylist()
    else:
        import json

        rows = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    table: dict = {}
    for r in rows:
        entry = table.setdefault(r["id"], {})
        if meta["output"]["layout"] == "long":
            entry[r["policy"]] = r["p"]
        else:
            entry.update({n: r[f"p_{n}"] for n in names})
    return table


def _find(meta: dict, ids: set, engine: Engine) -> dict:
    """id -> conversation text, re-read from the recorded inputs with the recorded read settings."""
    spec = ReadSpec(**{k: tuple(v) if k == "keep" else v for k, v in meta["read"].items()})
    found = {}
    for rec in meta["inputs"]:
        for chunk in read_chunks(Path(rec["path"]), spec, engine.encoder.render):
            for i, id_ in enumerate(chunk.ids.to_pylist()):
                if id_ in ids and chunk.texts[i] is not None:
                    found.setdefault(id_, chunk.texts[i])
    return found
