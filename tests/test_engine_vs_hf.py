"""The reference engine against transformers + PEFT: every architecture, tied/untied, sharded, mixed adapters."""
from __future__ import annotations

import zlib

import pytest
import torch
from hf_fixtures import WIDE_SPECS, hf_scores, make_bundle

from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.model.quant import quantize_checkpoint
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack
from policyscan.kernels import reference

pytest.importorskip("transformers")
pytest.importorskip("peft")

LABELS = [(3, 7), (11, 5), (20, 21)]
LENGTHS = [1, 5, 17, 3, 12, 9, 2, 30, 1]
ADAPTERS = [0, 1, 2, 0, 1, 2, 1, 2, 2]
CASES = [("llama", False, None), ("llama", True, "60KB"), ("mistral", False, None), ("qwen2", True, None),
         ("qwen3", False, "60KB")]


def build(tmp_path, arch, tie, shard, wide=False):
    """wide: WIDE_SPECS' adapters, whose stacks pass rank 64 (qkv 128)."""
    dirs = make_bundle(tmp_path, arch, "pol", 10, specs=WIDE_SPECS if wide else None, tie=tie, shard=shard)
    g = torch.Generator().manual_seed(zlib.crc32(f"{arch}{tie}".encode()))  # not hash(): salted per process
    seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in LENGTHS]
    return dirs, seqs


def engine_f(model_dir, dirs, seqs, dtype=torch.float32, fp8=False, adapters=ADAPTERS):
    dec = load_decoder(Checkpoint.open(model_dir), reference, Precision(dtype, fp8_weights=fp8))
    attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
    return dec.forward(pack(seqs, adapters)).double()


@pytest.mark.parametrize("arch,tie,shard,wide", [case + (False,) for case in CASES] + [("llama", False, None, True)])
def test_fp32_matches_hf(tmp_path, arch, tie, shard, wide):
    dirs, seqs = build(tmp_path, arch, tie, shard, wide)
    if shard:
        assert (tmp_path / "model" / "model.safetensors.index.json").is_file()
    ours = engine_f(tmp_path / "model", dirs, seqs)
    ref = hf_scores(tmp_path / "model", dirs, seqs, ADAPTERS, LABELS, torch.float32)
    err = (ours - ref).abs().max().item()
    print(f"{arch} tie={tie} shard={shard}: max |f - f_hf| = {err:.2e} (|f| ~ {ref.abs().mean():.3f})")
    assert err <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_bf16_no_worse_than_hf_bf16(tmp_path, arch):
    """The max over 9 sequences was too noisy a statistic (one draw: ours 2.4x HF, with the same mean error);
    over 30 sequences ours was 0.6-1.3x HF's max error in seven draws, with the same mean."""
    dirs, _ = build(tmp_path, arch, False, None)
    g = torch.Generator().manual_seed(zlib.crc32(arch.encode()))
    seqs = [torch.randint(0, 211, (int(n),), generator=g).tolist() for n in torch.randint(1, 40, (30,), generator=g)]
    ads = [i % 3 for i in range(30)]
    exact = hf_scores(tmp_path / "model", dirs, seqs, ads, LABELS, torch.float64)
    hf16 = hf_scores(tmp_path / "model", dirs, seqs, ads, LABELS, torch.bfloat16)
    ours = engine_f(tmp_path / "model", dirs, seqs, torch.bfloat16, adapters=ads)
    ours_err, hf_err = (ours - exact).abs().max().item(), (hf16 - exact).abs().max().item()
    print(f"{arch} bf16: ours {ours_err:.3e}, HF {hf_err:.3e} against fp64")
    assert ours_err <= 2 * hf_err


def test_fp8_checkpoint_matches_hf_on_dequantized_weights(tmp_path):
    """quantize -> load gives HF's f on the dequantized weights (fp32 compute), and FP8 moves p only a little."""
    from safetensors.torch import load_file, save_file

    dirs, seqs = build(tmp_path, "llama", False, None)
    fp8_dir = quantize_checkpoint(tmp_path / "model", tmp_path / "fp8")
    ck = Checkpoint.open(fp8_dir)
    assert ck.fp8 and ck.get("model.layers.0.self_attn.q_proj.weight").dtype == torch.float8_e4m3fn
    # HF can't run compressed-tensors here: give it the dequantized weights in a plain checkpoint.
    deq_dir = tmp_path / "deq"
    deq_dir.mkdir()
    tensors = load_file(fp8_dir / "model.safetensors")
    plain = {}
    for name, t in tensors.items():
        if name.endswith(".weight_scale"):
            continue
        scale = tensors.get(name[: -len(".weight")] + ".weight_scale") if name.endswith(".weight") else None
        plain[name] = t.float() * scale.float() if scale is not None else t
    save_file(plain, deq_dir / "model.safetensors")
    (deq_dir / "config.json").write_text((tmp_path / "model" / "config.json").read_text())
    ours = engine_f(fp8_dir, dirs, seqs, fp8=True)
    ref = hf_scores(deq_dir, dirs, seqs, ADAPTERS, LABELS, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4
    full = engine_f(tmp_path / "model", dirs, seqs)
    dp = (torch.sigmoid(ours) - torch.sigmoid(full)).abs()
    print(f"FP8 vs fp32 weights: max |dp| = {dp.max():.4f}, mean {dp.mean():.4f}")
    assert dp.max() < 0.05


def test_fp8_weights_requested_on_plain_checkpoint(tmp_path):
    dirs, seqs = build(tmp_path, "qwen2", False, None)
    a = engine_f(tmp_path / "model", dirs, seqs, fp8=True)
    b = engine_f(quantize_checkpoint(tmp_path / "model", tmp_path / "fp8"), dirs, seqs, fp8=True)
    assert torch.equal(a, b)


@pytest.mark.slow  # the whole decoder in Triton's interpreter, twice: 13-14 s an arch on an idle 2-core machine
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_triton_kernel_set_runs_the_decoder(tmp_path, arch):
    """The whole decoder on the Triton kernels (interpreted, fp32) agrees with the torch twins: catches a
    kernel-set interface slip in CI, not only on the GPU. Both with the prefix cache and without. The first six
    sequences (47 tokens: one of 1, one past a 16-row tile, every adapter twice): the interpreter's time grows
    with the tiles (all nine sequences: 20-21 s an arch), and the kernels' tiling has its own tests."""
    pytest.importorskip("triton")
    from policyscan.kernels import triton_ops

    dirs, seqs = build(tmp_path, arch, False, None)
    seqs, adapters = seqs[:6], ADAPTERS[:6]
    out = {}
    for name, ops in (("reference", reference), ("triton", triton_ops)):
        dec = load_decoder(Checkpoint.open(tmp_path / "model"), ops, Precision(torch.float32))
        attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
        plain = dec.forward(pack(seqs, adapters))
        cache = dec.prefill_prefixes([[1, 2, 3], [], [4, 5, 6, 7, 8]])
        cached = dec.forward(pack(seqs, adapters), prefix=cache)
        out[name] = torch.stack([plain, cached])
    assert (out["triton"] - out["reference"]).abs().max() <= 1e-4


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_attention_bias_on_every_projection_matches_hf(tmp_path, arch):
    """attention_bias: true puts a bias on q, k, v and o; none of them is dropped."""
    dirs = make_bundle(tmp_path, arch, "pol", 10, attention_bias=True)
    g = torch.Generator().manual_seed(zlib.crc32(f"bias{arch}".encode()))
    seqs = [torch.randint(0, 211, (n,), generator=g).tolist() for n in LENGTHS]
    ours = engine_f(tmp_path / "model", dirs, seqs)
    ref = hf_scores(tmp_path / "model", dirs, seqs, ADAPTERS, LABELS, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4
