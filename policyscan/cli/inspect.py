"""policyscan inspect PATH: what a model directory, policy bundle(s), input or output file holds."""
from __future__ import annotations

import json
import zlib
from pathlib import Path

import click

from policyscan.cli.common import default_model, friendly_errors, model_option
from policyscan.engine.errors import InputError
from policyscan.engine.outputs.sinks import read_metadata

BAD_LINES_SHOWN = 20


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@model_option
@friendly_errors
def inspect_cmd(path: str, model: str | None) -> None:
    """Describe PATH: a model directory, a policy bundle or a folder of them (with the token ids its verdict
    reads in --model's tokenizer), a scores output (its metadata), or an input file (JSONL: its malformed lines
    with their line numbers)."""
    p = Path(path)
    bundles = sorted(d for d in p.iterdir() if (d / "policy.json").is_file()) if p.is_dir() else []
    if p.is_dir() and (p / "policy.json").is_file():
        _echo(_policy(p, _encoder(model)))
    elif p.is_dir() and not (p / "config.json").is_file() and bundles:
        enc = _encoder(model)
        _echo({"policies": [_policy(d, enc) for d in bundles]})
    elif p.is_dir():
        from policyscan.engine.model.checkpoint import Checkpoint

        ck = Checkpoint.open(p)
        _echo({"model": str(p), "fp8": ck.fp8, **ck.config.__dict__, "rope": ck.config.rope.__dict__,
               "tensors": len(ck.files)})
    elif (meta := read_metadata(p)) is not None:
        _echo(meta)
    elif p.name.endswith(".parquet"):
        _echo(_parquet(p))
    else:
        _echo(_jsonl(p))


def _echo(obj: dict) -> None:
    click.echo(json.dumps(obj, indent=2, default=str))


def _encoder(model: str | None):
    from policyscan.engine.text.prompts import TextEncoder

    return TextEncoder(model or default_model(), fast=False)


def _policy(d: Path, enc) -> dict:
    from policyscan.engine.policy.bundle import load_policy

    pol = load_policy(d)
    ranks = sorted({a.shape[0] for a, _ in pol.lora.factors.values()})
    return {"policy": pol.name, "path": str(d), "description": pol.description,
            "labels": [pol.compliant, pol.violation], "verdict": _verdict(pol, enc),
            "prompt_only": not pol.lora.factors, "lora_ranks": ranks,
            "targets": sorted({proj for _, proj in pol.lora.factors}), "chat_template": pol.chat_template,
            "calibration": pol.calibration, "threshold": pol.threshold, "adapter_sha256": pol.adapter_sha256}


def _verdict(pol, enc) -> dict:
    """The token each label's logit is read from, in the model's tokenizer, and whether it starts a longer label."""
    ids = enc.verdict_ids(pol)
    out = {"model": str(enc.model_dir)}
    for (which, label), tid in zip((("compliant", pol.compliant), ("violation", pol.violation)), ids):
        tokens = enc.label_tokens(label)
        out[which] = {"label": label, "token_id": tid, "token": tokens[0], "label_tokens": tokens,
                      "reads": "the first token of a longer label" if len(tokens) > 1 else "the whole label"}
    return out


def _parquet(p: Path) -> dict:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(p)
    except (OSError, pa.ArrowException) as e:
        raise InputError(f"{p}: not a readable Parquet file ({e}); is it truncated?") from e
    return {"file": str(p), "rows": pf.metadata.num_rows, "row_groups": pf.num_row_groups,
            "columns": {f.name: str(f.type) for f in pf.schema_arrow}}


def _jsonl(p: Path) -> dict:
    """Rows, the fields seen with their JSON types, and the lines that are not JSON objects."""
    from policyscan.engine.inputs.jsonl import parsed_lines

    rows, line_no, bad, columns = 0, 0, [], {}
    try:
        for (line_no, obj, reason), _ in parsed_lines(p):
            rows += 1
            if obj is None:
                bad.append({"line": line_no, "reason": reason})
            for k, v in (obj or {}).items():
                columns.setdefault(k, set()).add(_json_type(v))
    except (OSError, EOFError, zlib.error) as e:
        raise InputError(f"{p}: unreadable after line {line_no} ({e}); is it truncated?") from e
    out = {"file": str(p), "rows": rows, "columns": {k: " | ".join(sorted(t)) for k, t in columns.items()},
           "bad_lines": len(bad)}
    if bad:
        out["first_bad_lines"] = bad[:BAD_LINES_SHOWN]
    return out


def _json_type(v) -> str:
    names = {str: "string", bool: "boolean", int: "number", float: "number", list: "array", dict: "object"}
    return "null" if v is None else names[type(v)]
