"""policyscan: score chatbot logs against compliance policies (LoRA adapters on one base model)."""
from __future__ import annotations

import signal
import sys

from policyscan.engine import compile_start, worker_start

# before the imports below (torch): workers fork from a server importing in parallel, and on a fresh machine the
# kernels' compiling workers import beside them too
worker_start.prestart(sys.argv[1:])
compile_start.prestart(sys.argv[1:])

import click  # noqa: E402

from policyscan.engine.runner import version  # noqa: E402
from policyscan.cli.calibrate import calibrate  # noqa: E402
from policyscan.cli.inspect import inspect_cmd  # noqa: E402
from policyscan.cli.quantize import quantize  # noqa: E402
from policyscan.cli.score import score  # noqa: E402
from policyscan.cli.verify import verify  # noqa: E402


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
