"""Shared CLI pieces: default model and policies, engine options, errors printed for people."""
from __future__ import annotations

import functools
import os
import sys
import threading
from pathlib import Path

import click

from ..engine.errors import PolicyscanError

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"
EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_ROW_ERRORS = 0, 1, 2, 3


def default_model() -> str:
    return os.environ.get("POLICYSCAN_MODEL") or str(SAMPLE / "model")


def default_policies() -> tuple[str, ...]:
    env = os.environ.get("POLICYSCAN_POLICIES")
    return tuple(env.split(os.pathsep)) if env else (str(SAMPLE / "policies"),)


def clip_chars(max_length: int) -> int:
    """Conversations longer than this many characters keep only their tail before tokenizing: 64 characters
    a token is far more than byte-level BPE ever averages, so the tokens kept after left truncation are the
    same, and a 1 GB row costs no more than a long one."""
    return max(64 * max_length, 65536)


def preload_arrow() -> None:
    """Start pyarrow's one-time setup in a thread while the model loads: pyarrow imports pandas (when it is
    installed) on the first array it builds from Python or numpy objects, which was the first chunk's write,
    0.28-0.42 s inside the scoring window of W1's E2E run on the device (run 41, bench/NOTES.md); and the
    writer's first `take` imports pyarrow.compute (0.07 s on the 2-core CPU machine)."""
    threading.Thread(target=_first_arrays, name="policyscan-preload-arrow").start()


def _first_arrays() -> None:
    import pyarrow as pa

    pa.array([0.0]).take(pa.array([0]))


def model_option(f):
    return click.option("--model", "model", default=None, metavar="DIR",
                        help="Hugging Face model directory [default: $POLICYSCAN_MODEL, else the sample model]")(f)


def engine_options(f):
    """--device, --precision, --batch-tokens, --max-length, --cuda-graphs."""
    for opt in reversed([
        click.option("--device", default="auto", show_default=True, help="auto | cpu | cuda | cuda:N"),
        click.option("--precision", default="auto", show_default=True,
                     type=click.Choice(["auto", "fp8", "bf16", "fp32"]),
                     help="auto: FP8 on a GPU, fp32 on the CPU"),
        click.option("--batch-tokens", default=65536, show_default=True, type=click.IntRange(2),
                     help="prompt tokens per packed batch"),
        click.option("--max-length", default=2048, show_default=True, type=click.IntRange(2),
                     help="longest prompt; longer conversations lose their oldest tokens"),
        click.option("--cuda-graphs/--no-cuda-graphs", default=True, show_default=True,
                     help="replay batches of up to 4096 tokens from CUDA graphs (GPU only; same results bit "
                          "for bit, fewer kernel launches)"),
    ]):
        f = opt(f)
    return f


def friendly_errors(f):
    """PolicyscanError -> one line on stderr and exit 1 (2 for usage); Ctrl-C -> exit 130, no traceback."""
    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except PolicyscanError as e:
            click.echo(f"policyscan: error: {e}", err=True)
            sys.exit(EXIT_FAILURE)
        except KeyboardInterrupt:
            click.echo("policyscan: interrupted; no partial output was left behind", err=True)
            sys.exit(130)
    return wrapper
