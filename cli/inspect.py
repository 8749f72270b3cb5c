"""policyscan inspect PATH: what a model directory, policy bundle, input or output file holds."""
from __future__ import annotations

import json
from pathlib import Path

import click

from ..engine.errors import InputError
from ..engine.sinks import read_metadata
from .common import friendly_errors


@click.command("inspect")
@click.argument("path", type=click.Path(exists=True))
@friendly_errors
def inspect_cmd(path: str) -> None:
    """Describe PATH: a model directory, a policy bundle, a scores output (its metadata), or an input file."""
    p = Path(path)
    if p.is_dir() and (p / "policy.json").is_file():
        from ..engine.policy import load_policy

        pol = load_policy(p)
        ranks = sorted({a.shape[0] for a, _ in pol.lora.factors.values()})
        projs = sorted({proj for _, proj in pol.lora.factors})
        click.echo(json.dumps({"policy": pol.name, "description": pol.description,
                               "labels": [pol.compliant, pol.violation], "lora_ranks": ranks, "targets": projs,
                               "calibration": pol.calibration, "threshold": pol.threshold,
                               "adapter_sha256": pol.adapter_sha256}, indent=2, default=str))
    elif p.is_dir():
        from ..engine.checkpoint import Checkpoint

        ck = Checkpoint.open(p)
        click.echo(json.dumps({"model": str(p), "fp8": ck.fp8, **ck.config.__dict__,
                               "rope": ck.config.rope.__dict__, "tensors": len(ck.files)}, indent=2, default=str))
    else:
        meta = read_metadata(p)
        if meta is not None:
            click.echo(json.dumps(meta, indent=2, default=str))
            return
        import polars as pl

        try:
            lf = pl.scan_parquet(p) if p.name.endswith(".parquet") else pl.scan_ndjson(p)
            schema = lf.collect_schema()
            rows = lf.select(pl.len()).collect().item()
        except Exception as e:  # polars raises many error types for unreadable files
            raise InputError(f"{p}: cannot read as Parquet or JSONL ({e})") from e
        click.echo(json.dumps({"file": str(p), "rows": rows, "columns": {k: str(v) for k, v in schema.items()}},
                              indent=2))
