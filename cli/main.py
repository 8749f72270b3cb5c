"""policyscan: score chatbot logs against compliance policies (LoRA adapters on one base model)."""
from __future__ import annotations

import signal

import click

from policyscan.engine.runner import version
from policyscan.cli.calibrate import calibrate
from policyscan.cli.inspect import inspect_cmd
from policyscan.cli.quantize import quantize
from policyscan.cli.score import score
from policyscan.cli.verify import verify


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version(), prog_name="policyscan")
def cli() -> None:
    """Batch compliance classifier: per-policy calibrated violation probabilities for conversation logs."""


cli.add_command(score)
cli.add_command(calibrate)
cli.add_command(quantize)
cli.add_command(inspect_cmd)
cli.add_command(verify)


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # same clean-up path as Ctrl-C: temporary files removed, nothing half-written


def main() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    cli()


if __name__ == "__main__":
    main()
