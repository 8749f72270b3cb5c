"""The package data: a non-editable install (a wheel) still has the sample model and policies that --model and
--policies default to. Built offline from a copy of the tree, so the working tree gets no build/ or egg-info."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEEDED = ["model/config.json", "model/model.safetensors", "model/tokenizer.json", "model/tokenizer_config.json",
          "policies/pii/policy.json", "policies/pii/adapter_model.safetensors",
          "policies/investment_advice/adapter_config.json", "conversations.parquet"]


def test_the_wheel_ships_the_sample_model_and_policies(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    import tomllib
    folders = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"].values()
    for name in ("pyproject.toml", "README.md", *sorted(set(folders))):
        copy = shutil.copytree if (ROOT / name).is_dir() else shutil.copy
        copy(ROOT / name, src / name, **({"ignore": shutil.ignore_patterns("__pycache__")}
                                          if (ROOT / name).is_dir() else {}))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", ".", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist")],
                   cwd=src, check=True, capture_output=True, timeout=300)
    wheel = next((tmp_path / "dist").glob("policyscan-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {f"policyscan/sample_data/{n}" for n in NEEDED} <= names
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("from pathlib import Path; import policyscan.cli.common as c; "
             "print(c.__file__); print(Path(c.default_model()).is_dir(), Path(c.default_policies()[0]).is_dir())")
    env = {k: v for k, v in os.environ.items() if not k.startswith("POLICYSCAN_")}
    res = subprocess.run([sys.executable, "-c", probe], env={**env, "PYTHONPATH": str(tmp_path / "site")},
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    where, found = res.stdout.splitlines()
    assert where.startswith(str(tmp_path / "site")) and found == "True True", res.stderr
