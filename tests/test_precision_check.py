"""FP8 against bf16 per policy: calibrate records how often the verdict flips, and `--precision auto` on a GPU
runs bf16 when a policy's recorded share is over the limit, saying which and why."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from click.testing import CliRunner

from policyscan.cli.main import cli
from policyscan.engine.model.precision import choose_precision
from policyscan.engine.policy.bundle import load_policy

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"


def test_calibrate_records_the_fp8_check(tmp_path, sample_slice):
    pol = tmp_path / "pii"
    shutil.copytree(SAMPLE / "policies" / "pii", pol)
    res = CliRunner().invoke(cli, ["calibrate", str(sample_slice["labeled"]), "--policy", str(pol),
                                   "--device", "cpu"])
    assert res.exit_code == 0, res.output
    check = json.loads((pol / "policy.json").read_text())["calibration"]["fp8_check"]
    assert check["rows"] == 80 and check["device"] == "cpu"
    assert 0.0 <= check["flip_share"] <= 1.0 and 0.0 <= check["max_dp"] < 1.0
    assert "of verdicts flip at threshold" in res.output


def test_auto_takes_bf16_on_a_gpu_when_a_policy_flips_too_often(tmp_path):
    pols = []
    for name, share in (("steady", 0.004), ("shaky", 0.025)):
        shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / name)
        meta = json.loads((tmp_path / name / "policy.json").read_text())
        meta["name"] = name
        meta["calibration"]["fp8_check"] = {"flip_share": share, "max_dp": 0.1, "rows": 100, "device": "cuda:0"}
        (tmp_path / name / "policy.json").write_text(json.dumps(meta))
        pols.append(load_policy(tmp_path / name))
    assert choose_precision("auto", True, pols[:1], 0.01) == ("fp8", None)
    precision, why = choose_precision("auto", True, pols, 0.01)
    assert precision == "bf16" and "2.5% of shaky's labeled verdicts" in why and "steady" not in why
    assert choose_precision("auto", True, pols, 0.03) == ("fp8", None)
    assert choose_precision("auto", False, pols, 0.01) == ("fp32", None)
    assert choose_precision("fp8", True, pols, 0.01) == ("fp8", None)


def test_the_flip_limit_is_an_option_and_recorded(tmp_path, sample_slice):
    from policyscan.engine.outputs.sinks import read_metadata

    out = tmp_path / "o.parquet"
    res = CliRunner().invoke(cli, ["score", str(sample_slice["parquet"]), "-o", str(out), "--no-progress",
                                   "--device", "cpu", "--fp8-flip-limit", "0.05"])
    assert res.exit_code == 0, res.output
    assert read_metadata(out)["settings"]["fp8_flip_limit"] == 0.05
    res = CliRunner().invoke(cli, ["score", str(sample_slice["parquet"]), "-o", str(tmp_path / "x.parquet"),
                                   "--fp8-flip-limit", "2"])
    assert res.exit_code == 2
