"""The package as installed: a non-editable install (a wheel) still has the sample model and policies that --model
and --policies default to (built offline from a copy of the tree, so the working tree gets no build/ or egg-info),
and no folder of the checkout's root shadows an installed module when Python runs there."""
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
    for name in ("pyproject.toml", "README.md", "policyscan"):
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


def test_no_folder_at_the_checkout_root_shadows_an_installed_module():
    """`python -m pytest` and `python -m ...` run from the root put it first on sys.path: a folder there named like
    an installed module (transformers imports one called `kernels`) would be imported in its place."""
    probe = ("import importlib.util, sys; names = sys.argv[1:]; "
             "print(' '.join(n for n in names if importlib.util.find_spec(n) is not None))")
    names = sorted(p.name for p in ROOT.iterdir() if p.is_dir() and p.name.isidentifier() and p.name != "policyscan")
    # -I: no script folder or working directory on sys.path, so only installed modules are found
    res = subprocess.run([sys.executable, "-I", "-c", probe, *names], cwd=ROOT / "tests", capture_output=True,
                         text=True, timeout=120, check=True)
    assert res.stdout.split() == [], f"folders at the root named like installed modules: {res.stdout.split()}"
