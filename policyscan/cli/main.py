"""policyscan: score chatbot logs against compliance policies (LoRA adapters on one base model)."""
from __future__ import annotations

import signal
import sys

from policyscan.engine.parallel import worker_start
from policyscan.engine.warmup import compile_start

# first, before the command's own imports (torch): workers fork from a server importing in parallel, and on a fresh
# machine the kernels' compiling workers import beside them too
worker_start.prestart(sys.argv[1:])
compile_start.prestart(sys.argv[1:])

import importlib  # noqa: E402

import click  # noqa: E402

from policyscan.engine.settings import version  # noqa: E402

# each command's module imported only when it runs: `score --ray` plans and writes without torch's import
# (docs/performance.md)
COMMANDS = {"score": "score:score", "calibrate": "calibrate:calibrate", "quantize": "quantize:quantize",
            "inspect": "inspect:inspect_cmd", "verify": "verify:verify",
            "report": "report:report",
            "evaluate": "evaluate:evaluate", "train": "train:train"}


class _Commands(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(COMMANDS)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name not in COMMANDS:
            return None
        module, attr = COMMANDS[name].split(":")
        return getattr(importlib.import_module(f"policyscan.cli.{module}"), attr)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(version(), prog_name="policyscan")
def cli() -> None:
    """Batch compliance classifier: per-policy calibrated violation probabilities for conversation logs."""


def _sigterm(signum, frame):
    raise KeyboardInterrupt  # same clean-up path as Ctrl-C: temporary files removed, nothing half-written


def main() -> None:
    signal.signal(signal.SIGTERM, _sigterm)
    cli()


if __name__ == "__main__":
    main()
