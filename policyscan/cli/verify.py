"""policyscan verify OUTPUT: re-score a sample of an output's rows as its metadata says, compare bit for bit."""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import sys
from pathlib import Path

import click
import numpy as np
import pyarrow.parquet as pq

from policyscan.cli.common import check_device, friendly_errors
from policyscan.engine.errors import InputError, PolicyscanError
from policyscan.engine.files import file_sha256
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.json_schema import OUTPUT_METADATA, check
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.precision import Precision
from policyscan.engine.outputs.run_output import recorded_rows, stored_rows
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine, resolve_device
from policyscan.engine.settings import EngineSettings, OptionError

EXIT_DIFFERS = 4
# verify encodes and scores its sample's conversations in memory at once: beyond this many ids it would hold an
# archive's worth of token ids (a sample larger than the output's ids is the whole output)
MAX_SAMPLE = 1 << 20


@click.command()
@click.argument("output", type=click.Path(exists=True, dir_okay=False))
@click.option("--sample", default=64, show_default=True, type=click.IntRange(1, MAX_SAMPLE),
              help="ids to re-score (all of them when the output has fewer)")
@click.option("--device", default=None, callback=check_device,
              help="override the recorded device (results may then differ)")
@friendly_errors
def verify(output: str, sample: int, device: str | None) -> None:
    """Re-score the rows of SAMPLE ids of OUTPUT with the model, policies and settings its metadata records.

    Exit status: 0 every sampled row reproduced bit for bit (p, and f in a --raw output), 4 some differ or the output
    holds another number of rows than its metadata records, 1 the run cannot be repeated
    (a model, tokenizer, chat template, adapter or input file changed or is missing; or the output records a prompt
    length other than the one this policyscan uses)."""
    out = Path(output)
    meta = read_metadata(out)
    if meta is None:
        raise PolicyscanError(f"{out}: no policyscan metadata; only `policyscan score` outputs can be verified")
    check(meta, OUTPUT_METADATA, f"{out}: its metadata", PolicyscanError)  # damaged: one line, not a traceback
    held, recorded = stored_rows(out), recorded_rows(meta)
    if held != recorded:  # a sample of ids cannot find rows that are gone
        click.echo(f"{out} cannot be read to its end: it is damaged" if held is None else
                   f"{out} holds {held} rows where its metadata records {recorded}: rows were removed or added since "
                   "it was written")
        sys.exit(EXIT_DIFFERS)
    _check_ids(out, meta)
    _check_model(meta)
    inputs = [_input_path(rec, out) for rec in meta["inputs"]]
    policies = [_recorded_policy(rec) for rec in meta["policies"]]
    s = meta["settings"]
    # the run's arithmetic as recorded (an FP8 checkpoint on the CPU is fp32 on dequantized weights, which the name
    # "fp8" alone would re-run as the W8A8 preview); outputs from before it was recorded: the name
    numerics = meta.get("numerics")
    run_device = str(meta["device"]).split(":")[0]
    device = device or run_device
    # without it: on the run's kind of device its own request decides again, elsewhere the name
    try:
        kind = resolve_device(device).type
    except (RuntimeError, ValueError) as e:  # a device name this torch does not know
        raise PolicyscanError(f"{out}: the recorded device {device!r} cannot be used here ({e}); pass --device") from e
    request = s["precision"] if kind == run_device else meta["precision"]
    try:
        settings = EngineSettings(device, request, s["batch_tokens"], s["max_length"],
                                  cuda_graphs=s.get("cuda_graphs", True), chat_template=s.get("chat_template"),
                                  text_is_rendered=s.get("text_is_rendered", False),
                                  fp8_flip_limit=s.get("fp8_flip_limit", 0.01))
    except OptionError as e:  # the metadata's, not this command line's: the run cannot be repeated (exit 1)
        raise PolicyscanError(f"{out}: the recorded settings cannot be run again: {e}") from e
    try:
        precision = Precision.from_record(numerics) if numerics else None
    except ValueError as e:
        raise PolicyscanError(f"{out}: the recorded numerics cannot be run again: {e}") from e
    try:
        engine = Engine(meta["model"]["path"], policies, settings, precision=precision)
    except OptionError as e:  # the recorded settings against this model (a batch that holds no prompt)
        raise PolicyscanError(f"{out}: the recorded settings cannot be run again: {e}") from e
    took = meta.get("max_length", s["max_length"])  # outputs from before the cap record --max-length alone
    if took != engine.max_length:
        raise PolicyscanError(f"{out}: its prompts could take {took} tokens, "
                              f"this policyscan cuts them at {engine.max_length}, the model's "
                              "max_position_embeddings (an output of a policyscan that did not cut prompts there); the "
                              "run cannot be repeated: score it again")
    if _template_id(meta.get("chat_template")) != _template_id(engine.encoder.describe_template()):
        raise PolicyscanError(f"the chat template changed since the run: {meta.get('chat_template')} then, "
                              f"{engine.encoder.describe_template()} now")
    raw = bool(meta["output"].get("raw"))  # f is stored too: calibrate and evaluate --from-scores read it
    columns = [f"{k}_{p.name}" for k in ("p", "f")[:1 + raw] for p in policies]
    stored = _stored(out, meta, [p.name for p in policies], raw)
    ids = sorted(stored, key=lambda i: hashlib.sha256(str(i).encode()).digest())[:sample]
    texts = _find(meta, inputs, set(ids), engine)
    missing = [i for i in ids if i not in texts]
    if missing:
        raise InputError(f"{len(missing)} sampled ids not found in the recorded inputs, e.g. {missing[0]!r}")
    flat = [(i, t) for i in ids for t in texts[i]]
    encoded = engine.encoder.encode_batch([t for _, t in flat])
    keep = [k for k, x in enumerate(encoded) if x]  # a text that encodes to nothing was an error row, not output
    f, _, _ = engine.score_conversations([np.asarray(encoded[k], dtype=np.int64) for k in keep])
    now: dict = {i: [] for i in ids}
    for r, (i, _) in enumerate(flat[k] for k in keep):
        p_now = tuple(float(pol.calibrate_np(f[r:r + 1, j])[0]) for j, pol in enumerate(policies))
        now[i].append(p_now + (tuple(float(v) for v in f[r]) if raw else ()))
    bad = [d for i in ids for d in _differences(i, stored[i], now[i], columns)]
    rows = sum(len(stored[i]) for i in ids)
    click.echo(f"verified {rows} rows ({len(ids)} ids) x {len(policies)} policies of {out}: "
               f"{'all reproduced bit for bit' if not bad else f'{len(bad)} differ'}")
    for i, name, want, got in bad[:10]:
        click.echo(f"  id {i!r} {name}: stored {want!r}, now {got!r}")
    sys.exit(EXIT_DIFFERS if bad else 0)


def _check_ids(out: Path, meta: dict) -> None:
    """An output whose `id` column holds a kept input column `id` instead of the --id-column's ids (score now
    refuses that --keep) cannot be matched with its inputs."""
    read = meta.get("read") or {}
    if "id" in (read.get("keep") or ()) and read.get("id_column") not in (None, "id"):
        raise PolicyscanError(f"{out}: its 'id' column holds the input column 'id' that --keep passed through, not "
                              f"the ids of --id-column {read['id_column']}; its rows cannot be matched with the "
                              "inputs: score it again without --keep id")


def _check_model(meta: dict) -> None:
    """The model's files (weights, config, tokenizer, chat templates) must be the ones the run used."""
    model = Path(meta["model"]["path"])
    if not model.is_dir():
        raise PolicyscanError(f"model {model} is missing; the run cannot be repeated")
    ckpt = Checkpoint.open(model)
    if ckpt.fingerprint(fresh=True) == meta["model"]["sha256"]:  # an audit reads the files, trusts no cache
        return
    was, now = meta.get("model_files") or {}, ckpt.file_hashes()  # read just now: cached
    changed = sorted(n for n in set(was) | set(now) if was.get(n) != now.get(n)) if was else []
    what = f": {', '.join(changed)} changed, appeared or disappeared" if changed else ""
    raise PolicyscanError(f"model {model} changed since the run{what}; the run cannot be repeated")


def _template_id(t: dict | None) -> str | None:
    """A template by its text, plain by its name: the path it was read from may differ (a relative --model)."""
    return None if t is None else t.get("sha256") or t.get("source")


def _recorded_policy(rec: dict):
    """The policy as the run had it: adapter bytes checked, calibration taken from the metadata."""
    path = Path(rec["path"]) / "adapter_model.safetensors"
    if rec["adapter_sha256"] is None:  # prompt-only then: it must still have no adapter
        if path.exists():
            raise PolicyscanError(f"policy {rec['name']!r}: {path} appeared since the run (it was prompt-only)")
    elif not path.is_file() or file_sha256(path) != rec["adapter_sha256"]:
        raise PolicyscanError(f"policy {rec['name']!r}: {path} is missing or changed since the run")
    pol = load_policy(rec["path"])
    if [pol.compliant, pol.violation, pol.prefix, pol.suffix] != [*rec["labels"], rec["prefix"], rec["suffix"]]:
        raise PolicyscanError(f"policy {rec['name']!r}: the labels or template in {rec['path']}/policy.json "
                              "changed since the run")
    cal = rec["calibration"]
    return dataclasses.replace(pol, a=cal["a"], b=cal["b"])


def _input_path(rec: dict, out: Path) -> Path:
    """An input where the metadata says (absolute, relative to the output, as typed), with its recorded bytes."""
    where = [rec.get("abs_path"), str(out.parent / rec["rel_path"]) if rec.get("rel_path") else None, rec["path"]]
    found = [Path(p) for p in dict.fromkeys(w for w in where if w) if Path(p).is_file()]
    for p in found:
        if file_sha256(p) == rec["sha256"]:
            return p
    state = f"changed since the run ({', '.join(map(str, found))})" if found else "missing"
    raise PolicyscanError(f"input {rec['path']} is {state}; looked at {', '.join(w for w in where if w)}")


def _stored(out: Path, meta: dict, names: list[str], raw: bool) -> dict:
    """id -> [(p per policy, then f per policy when raw), ...], one tuple per row with that id, in output order
    (wide or long)."""
    long = meta["output"]["layout"] == "long"
    kinds = ("p", "f")[:1 + raw]
    if out.name.endswith(".parquet"):
        cols = ["id", "policy", *kinds] if long else ["id"] + [f"{k}_{n}" for k in kinds for n in names]
        rows = pq.read_table(out, columns=cols).to_pylist()
    else:
        opener = gzip.open if out.name.endswith(".gz") else open
        with opener(out, "rt", encoding="utf-8") as fh:
            rows = [json.loads(line) for line in fh if line.strip()]
    table: dict = {}
    if long:  # a conversation's rows are its policies, consecutive
        for k in range(0, len(rows), len(names)):
            group = {r["policy"]: r for r in rows[k:k + len(names)]}
            table.setdefault(rows[k]["id"], []).append(tuple(group[n][c] for c in kinds for n in names))
    else:
        for r in rows:
            table.setdefault(r["id"], []).append(tuple(r[f"{c}_{n}"] for c in kinds for n in names))
    return table


def _differences(id_, stored: list[tuple], now: list[tuple], names: list[str]) -> list[tuple]:
    """(id, column, stored value, value now) for stored rows that no re-scored row of the same id reproduces: rows
    that share an id (the same id twice, texts alike or not) are matched as a multiset, never by position."""
    left = list(now)
    unmatched = []
    for row in stored:
        if row in left:
            left.remove(row)
        else:
            unmatched.append(row)
    out = []
    for k, row in enumerate(unmatched):
        other = left[k] if k < len(left) else (None,) * len(names)
        out += [(id_, n, want, got) for n, want, got in zip(names, row, other) if want != got]
    return out


def _find(meta: dict, inputs: list[Path], ids: set, engine: Engine) -> dict:
    """id -> every conversation text with that id, re-read from the inputs with the recorded read settings."""
    try:
        spec = ReadSpec(**{k: tuple(v) if k == "keep" else v for k, v in meta["read"].items()})
    except TypeError as e:  # a member this policyscan's ReadSpec does not have
        raise PolicyscanError(f"the metadata's read settings {meta['read']} cannot be used here ({e})") from e
    found: dict = {}
    for path in inputs:
        for chunk in read_chunks(path, spec, engine.encoder.render):
            for i, id_ in enumerate(chunk.ids.to_pylist()):
                if id_ in ids and chunk.texts[i] is not None:
                    found.setdefault(id_, []).append(chunk.texts[i])
    return found
