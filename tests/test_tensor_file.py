"""engine/tensor_file.py: an adapter's factors read without torch are bitwise safetensors' own tensors as float32,
in every float dtype PEFT may save, at odd shapes and offsets; a damaged file is refused with its name and why."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from cli_cases import SAMPLE
from policyscan.engine.errors import PolicyError
from policyscan.engine.policy import load_policy
from policyscan.engine.tensor_file import read_float_tensors

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def test_every_float_dtype_reads_as_safetensors_own_float32(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dtype in enumerate(DTYPES * 2):  # a 2-byte tensor of odd size leaves the next one unaligned
        shape = (1 + i, 3 + 2 * i) if i % 2 else (5,)
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (i - 4)
        if i == 1:
            t.view(-1)[:3] = torch.tensor([float("inf"), -0.0, 1e-40], dtype=torch.float64)  # kept as they are
        tensors[f"t{i}.{str(dtype)[6:]}"] = t.to(dtype)
    path = tmp_path / "a.safetensors"
    save_file(tensors, path)
    got = read_float_tensors(path)
    want = load_file(path)
    assert list(got) == sorted(want, key=lambda n: _offset(path, n))
    for name, t in want.items():
        g_t = got[name]
        assert g_t.dtype == np.float32 and g_t.shape == tuple(t.shape), name
        assert torch.equal(torch.from_numpy(g_t), t.float()), name  # torch takes each array as it is


def _offset(path, name: str) -> int:
    with open(path, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        return json.loads(f.read(n))[name]["data_offsets"][0]


def test_a_bf16_adapter_loads_as_its_fp32_copy(tmp_path):
    """The same scales, and factors bitwise the float32 adapter's rounded to bf16 and widened back."""
    fp32 = load_policy(SAMPLE / "policies" / "pii")
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    t = load_file(pol / "adapter_model.safetensors")
    save_file({k: v.bfloat16() for k, v in t.items()}, pol / "adapter_model.safetensors")
    bf16 = load_policy(pol)
    assert bf16.lora.scales == fp32.lora.scales and bf16.lora.factors.keys() == fp32.lora.factors.keys()
    for key, (a, b) in bf16.lora.factors.items():
        a32, b32 = (torch.from_numpy(x).bfloat16().float() for x in fp32.lora.factors[key])
        assert torch.equal(torch.from_numpy(a), a32) and torch.equal(torch.from_numpy(b), b32), key


@pytest.mark.parametrize("damage, why", [
    (lambda raw: raw[:5], "not a safetensors file"),
    (lambda raw: raw[:-7], "truncated or damaged"),
    (lambda raw: (10).to_bytes(8, "little") + b"{not json!" + raw[18:], "not valid JSON"),
    (lambda raw: (2).to_bytes(8, "little") + b"[]", "not a JSON object"),
])
def test_a_damaged_adapter_file_names_itself_and_why(tmp_path, damage, why):
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    w = pol / "adapter_model.safetensors"
    w.write_bytes(damage(w.read_bytes()))
    with pytest.raises(PolicyError, match=why) as e:
        load_policy(pol)
    assert str(w) in str(e.value)


@pytest.mark.parametrize("tensor, why", [
    (torch.arange(6, dtype=torch.int32).reshape(2, 3), "is I32; LoRA factors must be floating point"),
    (torch.zeros(2, 3, 4), "has shape \\[2, 3, 4\\]; a LoRA factor is a matrix"),
])
def test_a_factor_that_is_no_float_matrix_is_refused(tmp_path, tensor, why):
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    t = load_file(pol / "adapter_model.safetensors")
    name = sorted(t)[0]
    t[name] = tensor
    save_file(t, pol / "adapter_model.safetensors")
    with pytest.raises(PolicyError, match=why):
        load_policy(pol)
