"""policyscan quantize MODEL_DIR OUT_DIR."""
from __future__ import annotations

import os
from pathlib import Path

import click

from policyscan.cli.common import friendly_errors
from policyscan.engine.model.quant import quantize_checkpoint


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@friendly_errors
def quantize(model_dir: str, out_dir: str) -> None:
    """Write an FP8 (e4m3, per-channel scales) copy of MODEL_DIR in the compressed-tensors layout.

    The output loads in policyscan and in engines that read llm-compressor's FP8_DYNAMIC checkpoints.
    OUT_DIR may not be MODEL_DIR or inside it (usage error, exit 2): the copy would overwrite the original."""
    _refuse_overlap(Path(model_dir), Path(out_dir))
    out = quantize_checkpoint(model_dir, out_dir)
    click.echo(f"wrote {out}")


def _refuse_overlap(model: Path, out: Path) -> None:
    """Before anything is written: OUT_DIR is neither MODEL_DIR (by path or link) nor a folder inside it."""
    src, dst = model.resolve(), out.resolve()
    same = out.exists() and os.path.samefile(model, out)
    if same or dst == src or src in dst.parents:
        raise click.UsageError(f"OUT_DIR {out} is {'MODEL_DIR' if same or dst == src else 'inside MODEL_DIR'} "
                               f"{model}: the FP8 copy would overwrite or mix with the original; "
                               "choose a new folder outside it")
