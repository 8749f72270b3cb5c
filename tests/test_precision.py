"""Precision is decided once (engine/model/precision.py), validated, and what the loader and the decoder follow."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import load_decoder
from policyscan.engine.model.precision import Precision, decide_precision
from policyscan.engine.model.quant import quantize_checkpoint
from policyscan.kernels import reference

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
BF16, FP32 = torch.bfloat16, torch.float32
SHAKY = [SimpleNamespace(name="shaky", calibration={"fp8_check": {"flip_share": 0.5}})]


@pytest.mark.parametrize("requested,gpu,fp8_checkpoint,expected", [
    ("auto", False, False, ("fp32", FP32, False, False)),
    ("auto", False, True, ("fp8", FP32, True, False)),  # an FP8 checkpoint under auto on the CPU: dequantized
    ("auto", True, False, ("fp8", BF16, True, True)),
    ("fp8", False, False, ("fp8", BF16, True, True)),  # the CPU previews the GPU's W8A8 in the torch twins
    ("bf16", False, False, ("bf16", BF16, False, False)),
    ("bf16", False, True, ("fp8", FP32, True, False)),
    ("bf16", True, True, ("fp8", BF16, True, True)),
    ("fp32", True, False, ("fp32", FP32, False, False)),
])
def test_decided_from_the_request_the_device_and_the_checkpoint(requested, gpu, fp8_checkpoint, expected):
    p, why = decide_precision(requested, gpu, fp8_checkpoint, [], 0.01)
    assert (p.name, p.dtype, p.fp8_weights, p.w8a8) == expected and why is None
    assert p.packed_rope == p.w8a8


def test_an_fp8_checkpoint_outranks_a_policys_fp8_check():
    p, why = decide_precision("auto", True, False, SHAKY, 0.01)
    assert p == Precision(BF16) and "shaky" in why
    p, why = decide_precision("auto", True, True, SHAKY, 0.01)
    assert p == Precision(BF16, True, True) and why is None


def test_invalid_combinations_are_refused():
    for bad in (lambda: Precision(torch.float16), lambda: Precision(BF16, w8a8=True),
                lambda: Precision(FP32, True, True)):
        with pytest.raises(ValueError):
            bad()
    assert str(Precision(FP32, True)) == "fp8" and str(Precision(BF16)) == "bf16"


def test_an_fp8_checkpoint_loads_with_fp8_weights_only(tmp_path):
    ckpt = Checkpoint.open(quantize_checkpoint(SAMPLE / "model", tmp_path / "fp8"))
    with pytest.raises(ValueError, match="needs fp8_weights"):
        load_decoder(ckpt, reference, Precision(FP32))
    dec = load_decoder(ckpt, reference, Precision(BF16, True, True))
    assert dec.dtype == BF16 and type(dec.layers[0].qkv).__name__ == "Fp8LoraLinear"
    assert dec.rope_tables(8)[2] is not None  # W8A8: packed fp16 tables for the qkv GEMM's epilogue


@pytest.mark.parametrize("precision", [Precision(torch.float32), Precision(torch.bfloat16),
                                       Precision(torch.float32, fp8_weights=True),
                                       Precision(torch.bfloat16, fp8_weights=True, w8a8=True)])
def test_the_recorded_numerics_give_back_the_same_precision(precision):
    assert Precision.from_record(json.loads(json.dumps(precision.record()))) == precision
