"""policyscan.engine's public API: every exported name resolves to its stage's object, and importing the package
(or a torch-free part of it) imports no torch."""
from __future__ import annotations

import subprocess
import sys

import pytest

import policyscan.engine as engine


@pytest.mark.parametrize("name", engine.__all__)
def test_every_exported_name_is_its_modules_object(name):
    value = getattr(engine, name)
    assert getattr(value, "__name__", name) == name and value.__module__.startswith("policyscan.engine.")


def test_an_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'Scorers'"):
        engine.Scorers  # noqa: B018


def test_importing_the_engine_imports_no_torch_until_a_name_needs_it():
    code = ("import sys, policyscan.engine as e; assert 'torch' not in sys.modules; e.ReadSpec; e.load_policies; "
            "e.EngineSettings; e.PolicyscanError; assert 'torch' not in sys.modules, 'torch imported'; "
            "e.Engine; assert 'torch' in sys.modules")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
