"""policyscan quantize MODEL_DIR OUT_DIR."""
from __future__ import annotations

import click

from ..engine.quant import quantize_checkpoint
from .common import friendly_errors


@click.command()
@click.argument("model_dir", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@friendly_errors
def quantize(model_dir: str, out_dir: str) -> None:
    """Write an FP8 (e4m3, per-channel scales) copy of MODEL_DIR in the compressed-tensors layout.

    The output loads in policyscan and in engines that read llm-compressor's FP8_DYNAMIC checkpoints."""
    out = quantize_checkpoint(model_dir, out_dir)
    click.echo(f"wrote {out}")
