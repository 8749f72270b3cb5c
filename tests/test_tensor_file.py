"""engine/policy/tensor_file.py: an adapter's factors read without torch are bitwise safetensors' own tensors as
float32, in every float dtype PEFT may save, at odd shapes and offsets; a damaged file is refused with its name and
why."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch
from cli_cases import SAMPLE
from safetensors.torch import load_file, save_file

from policyscan.engine.errors import PolicyError
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.policy.tensor_file import UNTRACKED, TensorFile

DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
DEEP = b'{"t": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)  # -0.0 and 0.0, and NaN's payload, told apart


def test_every_float_dtype_reads_as_safetensors_own_float32(tmp_path):
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}")
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, dtype in enumerate(DTYPES * 2):
        shape = (1 + i, 3 + 2 * i) if i % 2 else (5,)
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 10.0 ** (i - 4)
        if i == 1:
            t.view(-1)[:3] = torch.tensor([float("inf"), -0.0, 1e-40], dtype=torch.float64)  # kept as they are
        tensors[f"t{i}.{str(dtype)[6:]}"] = t.to(dtype)
    path = tmp_path / "a.safetensors"
    save_file(tensors, path)
    got, want = TensorFile(path), load_file(path)
    assert got.names == sorted(want)
    for name, t in want.items():
        g_t = got.float32(name)
        assert g_t.dtype == np.float32 and g_t.shape == tuple(t.shape), name
        assert torch.equal(_bits(torch.from_numpy(g_t)), _bits(t.float())), name


def _write(path, entries: list[tuple[str, str, list[int], bytes]]) -> None:
    """A safetensors file by hand: (name, dtype, shape, bytes) back to back."""
    header, at = {}, 0
    for name, dtype, shape, data in entries:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        at += len(data)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)  # the data 8-aligned in the file, as safetensors pads it
    path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(e[3] for e in entries))


def test_a_float32_tensor_after_an_odd_2_byte_one_is_read_unaligned_and_whole(tmp_path):
    """safetensors' own writer aligns its tensors; another writer need not: this float32 starts at data byte 2."""
    a, b = np.array([1.5], "<f2"), np.arange(7, dtype="<f4") - 3.25
    path = tmp_path / "odd.safetensors"
    _write(path, [("a", "F16", [1], a.tobytes()), ("b", "F32", [7], b.tobytes())])
    got = TensorFile(path)
    assert got.float32("a").tolist() == [1.5]
    t = got.float32("b")
    assert t.flags.aligned and t.tobytes() == b.tobytes() and torch.equal(torch.from_numpy(t), torch.from_numpy(b))


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
        assert torch.equal(_bits(torch.from_numpy(a)), _bits(a32)) and torch.equal(_bits(torch.from_numpy(b)),
                                                                                     _bits(b32)), key


def _header(raw: bytes, change) -> bytes:
    """The file with its header's JSON changed by `change` (length fixed up)."""
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + n])
    change(header)
    text = json.dumps(header).encode()
    return len(text).to_bytes(8, "little") + text + raw[8 + n:]


def _first(header: dict) -> dict:
    return header[sorted(k for k in header if k != "__metadata__")[0]]


@pytest.mark.parametrize("damage, why", [
    (lambda raw: raw[:5], "not a safetensors file"),
    (lambda raw: raw[:20], "the header is cut short"),
    (lambda raw: raw[:-7], "need .* data bytes and it holds .*truncated"),
    (lambda raw: raw + b"\0" * 4, "bytes after its tensors"),
    (lambda raw: (10).to_bytes(8, "little") + b"{not json!" + raw[18:], "not valid JSON"),
    (lambda raw: (2).to_bytes(8, "little") + b"[]", "not a JSON object"),
    (lambda raw: len(DEEP).to_bytes(8, "little") + DEEP, "header is JSON nested too deeply"),  # json's RecursionError
    (lambda raw: _header(raw, lambda h: _first(h).update(data_offsets=[0])), "no valid dtype, shape and data_off"),
    (lambda raw: _header(raw, lambda h: _first(h).update(data_offsets=["0", 4])), "no valid dtype, shape"),
    (lambda raw: _header(raw, lambda h: _first(h).update(dtype=["F32"])), "no valid dtype, shape"),
    (lambda raw: _header(raw, lambda h: _first(h).update(shape=[True, 2])), "no valid dtype, shape"),
    (lambda raw: _header(raw, lambda h: _first(h).update(shape=[1, 1])), "do not hold its shape"),
    (lambda raw: _header(raw, lambda h: [v.update(data_offsets=[0, v["data_offsets"][1] - v["data_offsets"][0]])
                                         for k, v in h.items() if k != "__metadata__"]), "starts at data byte 0, not"),
])
def test_a_damaged_adapter_file_names_itself_and_why(tmp_path, damage, why):
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    w = pol / "adapter_model.safetensors"
    w.write_bytes(damage(w.read_bytes()))
    with pytest.raises(PolicyError, match=why) as e:
        load_policy(pol)
    assert str(w) in str(e.value)


@pytest.mark.parametrize("tensor, name, why", [
    (torch.arange(6, dtype=torch.int32).reshape(2, 3), 0, "is I32; LoRA factors must be floating point"),
    (torch.zeros(2, 3, 4), 0, "has shape \\[2, 3, 4\\]; a LoRA factor is a matrix"),
    (torch.arange(6, dtype=torch.int64), "base_model.model.lm_head.bias", "not a LoRA factor"),  # the name first
])
def test_a_tensor_that_is_no_float_factor_matrix_is_refused(tmp_path, tensor, name, why):
    pol = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    t = load_file(pol / "adapter_model.safetensors")
    t[sorted(t)[name] if isinstance(name, int) else name] = tensor
    save_file(t, pol / "adapter_model.safetensors")
    with pytest.raises(PolicyError, match=why):
        load_policy(pol)


@pytest.mark.skipif(UNTRACKED, reason="Python 3.13+ maps without keeping a descriptor")
def test_running_out_of_file_descriptors_says_which_limit(tmp_path):
    """Each mapping keeps a descriptor before Python 3.13: past the limit, the error names it, not errno 24."""
    for k in range(4):
        shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / f"p{k}")
    code = ("import os, resource, sys\nfrom policyscan.engine.policy.bundle import load_policy\n"
            "paths = sys.argv[1:]\nload_policy(paths[0])  # every import done before the limit\n"
            "n = len(os.listdir('/proc/self/fd'))\nresource.setrlimit(resource.RLIMIT_NOFILE, (n + 2, n + 2))\n"
            "keep = [load_policy(p) for p in paths]\n")
    res = subprocess.run([sys.executable, "-c", code, *map(str, sorted(tmp_path.iterdir()))], capture_output=True,
                         text=True)
    assert res.returncode == 1 and "PolicyError" in res.stderr and "ulimit -n" in res.stderr, res.stderr
