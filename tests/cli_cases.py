"""Shared by the CLI tests: the sample data, a conversation with a PII violation, and a CLI call."""
from __future__ import annotations

import sys
from pathlib import Path

from click.testing import CliRunner

from policyscan.cli.main import cli

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
sys.path.insert(0, str(SAMPLE))
from synth import conversations  # noqa: E402

MSG = next(c["messages"] for c in conversations(20, seed=99) if c["pii"] and not c["investment_advice"])


def run(*args, ok=(0,)):
    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    assert result.exit_code in ok, result.output
    return result
