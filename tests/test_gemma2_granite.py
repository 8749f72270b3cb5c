"""gemma2 and granite on the CPU path against transformers + PEFT, their kernels (soft-capped attention and head,
GELU-tanh epilogue) under Triton's interpreter, batch invariance, and the config fields refused by name."""
from __future__ import annotations

import pytest
import torch
from hf_fixtures import hf_scores, make_bundle

from policyscan.engine.errors import CheckpointError
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.config import ModelConfig
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack
from policyscan.kernels import reference
from policyscan.kernels.reference import AttnShape, PrefixKV

pytest.importorskip("transformers")
pytest.importorskip("peft")

LABELS = [(3, 7), (11, 5), (20, 21)]
LENGTHS = [1, 5, 17, 3, 12, 9, 2, 30]  # the fixture's window is 9: four sequences are longer
ADAPTERS = [0, 1, 2, 0, 1, 2, 1, 2]


@pytest.fixture(scope="module", params=["gemma2", "granite"])
def bundle(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    return request.param, root / "model", make_bundle(root, request.param, "pol", 10)


def sequences(seed: int, lengths: list[int] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]


def decoder(model_dir, dirs, ops=reference, dtype=torch.float32):
    dec = load_decoder(Checkpoint.open(model_dir), ops, Precision(dtype))
    attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
    return dec


def test_fp32_matches_hf(bundle):
    arch, model_dir, dirs = bundle
    seqs = sequences(1)
    ours = decoder(model_dir, dirs).forward(pack(seqs, ADAPTERS)).double()
    ref = hf_scores(model_dir, dirs, seqs, ADAPTERS, LABELS, torch.float32)
    err = (ours - ref).abs().max().item()
    print(f"{arch}: max |f - f_hf| = {err:.2e} (|f| ~ {ref.abs().mean():.3f})")
    assert err <= 1e-4


def test_gemma2_tied_embeddings_match_hf(tmp_path):
    """Tied: the head reads the unscaled embedding rows while the input lookup is scaled by sqrt(hidden)."""
    dirs = make_bundle(tmp_path, "gemma2", "pol", 3, tie=True)
    seqs = sequences(2, [4, 11, 25])
    ours = decoder(tmp_path / "model", dirs).forward(pack(seqs, [0, 1, 2])).double()
    ref = hf_scores(tmp_path / "model", dirs, seqs, [0, 1, 2], LABELS, torch.float32)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_batch_invariance_on_the_cpu(bundle):
    """A sequence alone and in batches of others (in two orders): bitwise the same f, fp32 and bf16."""
    _, model_dir, dirs = bundle
    seqs = sequences(3, [23, 1, 40, 7, 13, 2, 31, 9])
    ads = [1, 0, 2, 2, 1, 0, 0, 2]
    for dtype in (torch.float32, torch.bfloat16):
        dec = decoder(model_dir, dirs, dtype=dtype)
        with torch.inference_mode():
            alone = torch.stack([dec.forward(pack([s], [a]))[0] for s, a in zip(seqs, ads)])
            together = dec.forward(pack(seqs, ads))
            order = sorted(range(len(seqs)), key=lambda i: (ads[i], -i))
            grouped = dec.forward(pack([seqs[i] for i in order], [ads[i] for i in order]))
        assert torch.equal(together, alone)
        assert torch.equal(grouped, alone[order])


def test_triton_kernel_set_runs_the_decoder(bundle):
    """The whole decoder on the Triton kernels (interpreted, fp32) agrees with the torch twins, with the prefix
    cache and without: soft-capped attention and head, GELU-tanh epilogue, the sandwich norms' prologues."""
    pytest.importorskip("triton")
    from policyscan.kernels import triton_ops

    _, model_dir, dirs = bundle
    seqs = sequences(4, [3, 14, 1, 11])
    ads = [0, 1, 1, 2]
    out = []
    for ops in (reference, triton_ops):
        dec = decoder(model_dir, dirs, ops)
        cache = dec.prefill_prefixes([[1, 2, 3], [], [4, 5, 6, 7, 8]])
        out.append(torch.stack([dec.forward(pack(seqs, ads)), dec.forward(pack(seqs, ads), prefix=cache)]))
    assert (out[1] - out[0]).abs().max() <= 1e-4


@pytest.mark.parametrize("last_only,window,with_prefix", [(False, 5, False), (True, None, True), (False, None, True)])
def test_softcapped_attention_kernel(last_only, window, with_prefix):
    """Triton's soft-capped attention (interpreted, fp32) against the twin in fp32 and in fp64."""
    pytest.importorskip("triton")
    from policyscan.kernels.attention import varlen_attention

    g = torch.Generator().manual_seed(5)
    shape, lengths = AttnShape(6, 2, 16), [1, 9, 20, 4]
    T, width = sum(lengths), (6 + 2 * 2) * 16
    qkv = torch.randn(T, width, generator=g) * 2  # scores of several units: the cap of 3 bends them
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    prefix = None
    if with_prefix:
        rows = torch.randn(7, width, generator=g) * 2
        prefix = PrefixKV(rows, torch.tensor([0, 3, 0, 0], dtype=torch.int32),
                          torch.tensor([3, 4, 0, 2], dtype=torch.int32))
    kw = dict(window=window, last_only=last_only, prefix=prefix, softcap=3.0)
    ours = varlen_attention(qkv, cu, shape, 0.2, **kw)
    twin = reference.varlen_attention(qkv, cu, shape, 0.2, **kw)
    p64 = PrefixKV(prefix.rows.double(), prefix.start, prefix.length) if prefix is not None else None
    exact = reference.varlen_attention(qkv.double(), cu, shape, 0.2, **{**kw, "prefix": p64})
    assert (twin.double() - exact).abs().max() <= 1e-5
    assert (ours.double() - exact).abs().max() <= 1e-5
    plain = reference.varlen_attention(qkv, cu, shape, 0.2, window=window, last_only=last_only, prefix=prefix)
    assert (plain - twin).abs().max() > 1e-2  # the cap changed the result


def test_softcapped_head_kernel():
    pytest.importorskip("triton")
    from policyscan.kernels.head import head

    g = torch.Generator().manual_seed(6)
    h, w = torch.randn(5, 40, generator=g), 1 + 0.2 * torch.randn(40, generator=g)
    rows = torch.randn(3, 2, 40, generator=g)
    ad = torch.tensor([2, 0, -1, 1, 2], dtype=torch.int32)
    ours, twin = head(h, w, 1e-6, rows, ad, softcap=2.5), reference.head(h, w, 1e-6, rows, ad, softcap=2.5)
    exact = reference.head(h.double(), w.double(), 1e-6, rows.double(), ad, softcap=2.5)
    assert ours[2] == 0 and twin[2] == 0
    assert (ours.double() - exact).abs().max() <= 1e-5 and (twin.double() - exact).abs().max() <= 1e-5


def test_gelu_tanh_gemm_epilogue():
    """lora_gemm's GELU-tanh-and-mul (interpreted, fp32) against the twin in fp64, with stacked LoRA."""
    pytest.importorskip("triton")
    from policyscan.kernels.lora_gemm import lora_gemm

    g = torch.Generator().manual_seed(7)
    M, K, N, R = 37, 48, 2 * 40, 6
    x, W = torch.randn(M, K, generator=g), torch.randn(N, K, generator=g) * 0.3
    s, B = torch.randn(M, R, generator=g), torch.randn(2, N, R, generator=g) * 0.2
    ad = torch.sort(torch.randint(-1, 2, (M,), generator=g, dtype=torch.int32)).values
    args = (None, W, None, s, B, ad, None, None)
    ours = lora_gemm(x, *args, torch.float32, True, gelu=True)
    exact = reference.lora_gemm(x.double(), None, W.double(), None, s.double(), B.double(), ad, None, None,
                                torch.float64, True, gelu=True)
    silu = reference.lora_gemm(x, *args, torch.float32, True)
    assert ours.shape == (M, N // 2)
    assert (ours.double() - exact).abs().max() <= 1e-4
    assert (silu - ours).abs().max() > 1e-2


BASE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, vocab_size=50)


@pytest.mark.parametrize("arch,extra,named", [
    ("Gemma2ForCausalLM", {"hidden_activation": "gelu"}, "hidden_activation"),
    ("Gemma2ForCausalLM", {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ("Gemma2ForCausalLM", {"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ("Gemma2ForCausalLM", {"layer_types": ["full_attention"]}, "layer_types"),
    ("Gemma2ForCausalLM", {"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ("GraniteForCausalLM", {"attention_bias": True}, "attention_bias"),
    ("GraniteForCausalLM", {"residual_multiplier": -1.0}, "residual_multiplier"),
    ("GraniteForCausalLM", {"hidden_act": "gelu"}, "hidden_act"),
    ("LlamaForCausalLM", {"mlp_bias": True}, "mlp_bias"),
])
def test_unsupported_fields_are_refused_by_name(arch, extra, named):
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dict({"architectures": [arch], **BASE, **extra})


def test_config_defaults_follow_hf():
    """Missing keys take HF's defaults: gemma2 caps 50 / 30, scalar 256, window 4096 on even layers, tied."""
    cfg = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **BASE, "num_hidden_layers": 3})
    assert (cfg.attn_softcap, cfg.final_softcap, cfg.scale, cfg.tie_embeddings) == (50.0, 30.0, 256 ** -0.5, True)
    assert [cfg.window(i) for i in range(3)] == [4096, None, 4096]
    off = ModelConfig.from_dict({"architectures": ["Gemma2ForCausalLM"], **BASE, "final_logit_softcapping": None})
    assert off.final_softcap is None
    granite = ModelConfig.from_dict({"architectures": ["GraniteForCausalLM"], **BASE})
    assert (granite.scale, granite.embed_scale, granite.residual_scale, granite.logits_scale) == (1.0, 1.0, 1.0, 1.0)
