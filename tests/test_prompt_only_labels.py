"""Policy labels as guard models' cards read them: a label longer than one token is read from its first token
when the two labels' first tokens differ; labels that start alike are refused; inspect says which token it reads."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from policyscan.cli.main import cli
from policyscan.engine.errors import PolicyError
from policyscan.engine.policy.bundle import load_policies, load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.engine.text.prompts import TextEncoder

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"


def _labelled(tmp_path: Path, name: str, compliant: str, violation: str) -> Path:
    d = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / name)
    meta = json.loads((d / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, "name": name,
                                               "labels": {"compliant": compliant, "violation": violation}}))
    return d


def test_longer_labels_are_read_from_their_first_token(tmp_path):
    enc = TextEncoder(SAMPLE / "model", fast=False)
    long = load_policy(_labelled(tmp_path, "long", " Compliant response", " Violation found"))
    short = load_policy(SAMPLE / "policies" / "pii")
    assert enc.label_tokens(long.violation)[0] == "ĠViolation" and len(enc.label_tokens(long.violation)) > 1
    assert enc.verdict_ids(long) == enc.verdict_ids(short)
    eng = Engine(SAMPLE / "model", load_policies([SAMPLE / "policies" / "pii", tmp_path / "long"]),
                 EngineSettings("cpu", "fp32", batch_tokens=512, max_length=256))
    f, _, _ = eng.score_conversations([np.asarray(enc.encode("user: my SSN is 123-45-6789."))])
    assert f[0, 0].tobytes() == f[0, 1].tobytes()


def test_labels_that_start_with_the_same_token_are_refused(tmp_path):
    enc = TextEncoder(SAMPLE / "model", fast=False)
    same = load_policy(_labelled(tmp_path, "same", " Compliant.", " Compliant!"))
    with pytest.raises(PolicyError, match=r"policy 'same' .* start with the same token, so the first token cannot"):
        enc.verdict_ids(same)


def test_inspect_shows_the_token_ids_the_verdict_reads(tmp_path):
    res = CliRunner().invoke(cli, ["inspect", str(_labelled(tmp_path, "long", " Compliant response", " Violation!")),
                                   "--model", str(SAMPLE / "model")])
    assert res.exit_code == 0, res.output
    verdict = json.loads(res.output)["verdict"]
    assert verdict["compliant"]["token_id"] == 331 and verdict["violation"]["token_id"] == 330
    assert verdict["violation"]["label_tokens"] == ["ĠViolation", "!"]
    assert verdict["violation"]["reads"] == "the first token of a longer label"
    whole = json.loads(CliRunner().invoke(cli, ["inspect", str(SAMPLE / "policies" / "pii")]).output)["verdict"]
    assert whole["compliant"]["reads"] == "the whole label"
