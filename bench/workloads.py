"""The workloads of docs/performance.md: random-weight decoders of the W1-W6 shapes and seeded prompt lengths.

Random weights are fine for speed (values don't change FLOPs); everything is seeded."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from policyscan.engine.model.config import ModelConfig, RopeConfig
from policyscan.engine.model.layers import DenseLoraLinear, Fp8LoraLinear, LoraStack, Prologue
from policyscan.engine.model.loader import GROUPS
from policyscan.engine.model.model import Decoder, DecoderLayer
from policyscan.engine.model.precision import Precision
from policyscan.engine.model.quant import quantize_weight

LLAMA3_ROPE = RopeConfig(theta=500000.0, kind="llama3", factor=32.0, low_freq_factor=1.0, high_freq_factor=4.0,
                         original_max_position=8192)


def gemma3(hidden: int, intermediate: int, layers: int, heads: int, kv_heads: int, window: int) -> ModelConfig:
    """A Gemma 3 text decoder as its configs have it: head_dim 256, five sliding layers then a full one, rope 1e6 on
    full and 1e4 on sliding layers, query_pre_attn_scalar 256, vocabulary 262144, tied, no soft-capping."""
    return ModelConfig("gemma3", hidden, intermediate, layers, heads, kv_heads, 256, 262144, 1e-6,
                       RopeConfig(theta=1e6), True, qk_norm=True, sliding_window=window,
                       sliding_layers=tuple(bool((i + 1) % 6) for i in range(layers)),
                       sliding_rope=RopeConfig(theta=1e4), attn_scale=256 ** -0.5, embed_scale=hidden ** 0.5,
                       max_position=32768)


def shape(name: str) -> ModelConfig:
    if name == "tiny":  # dry runs of the scripts on a CPU
        return ModelConfig("llama", 64, 96, 2, 4, 2, 16, 1024, 1e-5, LLAMA3_ROPE, True)
    if name == "3b":
        return ModelConfig("llama", 3072, 8192, 28, 24, 8, 128, 128256, 1e-5, LLAMA3_ROPE, True)
    if name == "1b":
        return ModelConfig("llama", 2048, 8192, 16, 32, 8, 64, 128256, 1e-5, LLAMA3_ROPE, True)
    if name == "8b":  # Llama 3.1 8B's shape (its embeddings tied here: the head reads two rows either way)
        return ModelConfig("llama", 4096, 14336, 32, 32, 8, 128, 128256, 1e-5, LLAMA3_ROPE, True)
    if name == "gemma3-1b":  # Gemma 3 1B's shape
        return gemma3(1152, 6912, 26, 4, 1, 512)
    if name == "gemma3-tiny":  # dry runs of W6's code path on a CPU (its vocabulary is 262144 too)
        return gemma3(64, 96, 7, 2, 1, 16)
    raise ValueError(name)


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    adapters: int
    conversations: int
    prefix: int = 0
    median: int = 250   # conversation lengths in tokens: lognormal with this median and sigma, clipped to
    sigma: float = 0.8  # 16..longest
    longest: int = 2048

    @property
    def max_length(self) -> int:
        """The --max-length that truncates no prompt of the workload (the policy's prefix and suffix added)."""
        return max(2048, self.longest + 256)


WORKLOADS = {"T1": Workload("T1", "tiny", 3, 8), "T2": Workload("T2", "tiny", 3, 8, 16),
             "W1": Workload("W1", "3b", 8, 256), "W2": Workload("W2", "3b", 8, 256, 256),
             "W3": Workload("W3", "3b", 64, 64), "W4": Workload("W4", "1b", 8, 256),
             "W5": Workload("W5", "8b", 4, 128, median=1500, sigma=0.95, longest=8192),
             "W6": Workload("W6", "gemma3-1b", 8, 256), "T3": Workload("T3", "gemma3-tiny", 3, 8)}


def lengths(n: int, seed: int = 0, median: int = 250, sigma: float = 0.8, longest: int = 2048) -> np.ndarray:
    """Lognormal conversation lengths, seeded; W1's: median 250, sigma 0.8, clipped to 16..2048 (mean about 364)."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(median), sigma, n)), 16, longest).astype(np.int64)


def workload_lengths(w: Workload, seed: int = 0) -> np.ndarray:
    return lengths(w.conversations, seed, w.median, w.sigma, w.longest)


def prompts(w: Workload, vocab: int, seed: int = 0) -> tuple[list[list[int]], list[int], list[list[int]]]:
    """Every conversation under every adapter: (token ids without the policy prefix, adapter index) pairs,
    and each adapter's prefix (empty without one)."""
    rng = np.random.default_rng(seed + 1)
    convs = [rng.integers(0, vocab, int(n)).tolist() for n in workload_lengths(w, seed)]
    prefixes = [rng.integers(0, vocab, w.prefix).tolist() for _ in range(w.adapters)]
    seqs, ads = [], []
    for c in convs:
        for a in range(w.adapters):
            seqs.append(c)
            ads.append(a)
    return seqs, ads, prefixes


def random_decoder(cfg: ModelConfig, n_adapters: int, rank: int, ops, device="cuda", fp8: bool = True,
                   seed: int = 0) -> Decoder:
    """A decoder with random weights (FP8 W8A8 or bf16) and n random rank-r adapters on all seven projections. A gemma
    layer (cfg.gemma) as the loader builds one: fp32 norm weights, head norms, the norms after attention and MLP, the
    GELU-tanh gate."""
    g = torch.Generator(device=device).manual_seed(seed)
    dt = torch.bfloat16

    def rnd(*s, scale=1.0):
        return (torch.randn(*s, generator=g, device=device, dtype=torch.float32) * scale).to(dt)

    def linear(out: int, k: int, prologue: Prologue, silu_out: bool = False) -> DenseLoraLinear:
        w = rnd(out, k, scale=k ** -0.5)  # random rows: their gate/up interleaving does not matter
        if fp8:
            w8, sc = quantize_weight(w)
            return Fp8LoraLinear(w8, sc, None, prologue, ops, silu_out, cfg.gemma)
        return DenseLoraLinear(w, None, prologue, ops, silu_out, cfg.gemma)

    def stack(projs) -> LoraStack:
        k = cfg.proj_shape(projs[0])[1]
        outs = [cfg.proj_shape(p)[0] for p in projs]
        R = rank * len(projs)
        B = torch.zeros(n_adapters, sum(outs), R, device=device, dtype=dt)
        o0 = 0
        for i, o in enumerate(outs):  # block-diagonal, as attach_policies lays fused projections out
            B[:, o0:o0 + o, i * rank:(i + 1) * rank] = rnd(n_adapters, o, rank, scale=0.01)
            o0 += o
        return LoraStack(rnd(n_adapters, R, k, scale=k ** -0.5), B)

    ones = torch.ones(cfg.hidden, device=device, dtype=torch.float32 if cfg.gemma else dt)
    heads = torch.ones(cfg.head_dim, device=device, dtype=ones.dtype) if cfg.qk_norm else None
    post = ones if cfg.gemma else None
    layers = []
    for _ in range(cfg.layers):
        layer = DecoderLayer(
            qkv=linear(cfg.q_size + 2 * cfg.kv_size, cfg.hidden, Prologue(ones, cfg.rms_eps)),
            o=linear(cfg.hidden, cfg.q_size, Prologue()),
            gate_up=linear(2 * cfg.intermediate, cfg.hidden, Prologue(ones, cfg.rms_eps), silu_out=True),
            down=linear(cfg.hidden, cfg.intermediate, Prologue()), q_norm=heads, k_norm=heads, post_attn_norm=post,
            post_mlp_norm=post)
        for group, projs in GROUPS.items():
            getattr(layer, group).set_lora(stack(projs))
        layers.append(layer)
    embed = rnd(cfg.vocab, cfg.hidden, scale=0.02)
    dec = Decoder(cfg, Precision(dt, fp8, fp8), embed, layers, ones, ops, lambda ids: embed[ids].float())
    dec.head = torch.randn(n_adapters, cfg.hidden, generator=g, device=device) * 0.02
    return dec


def left_padded(prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask of a batch, left-padded: the HF + PEFT baseline's batches."""
    n = max(map(len, prompts))
    ids = torch.zeros(len(prompts), n, dtype=torch.long)
    mask = torch.zeros(len(prompts), n, dtype=torch.long)
    for r, c in enumerate(prompts):
        ids[r, n - len(c):] = torch.as_tensor(c)
        mask[r, n - len(c):] = 1
    return ids, mask


def hf_peft_model(cfg: ModelConfig, n_adapters: int, rank: int = 16, device: str = "cuda"):
    """The same shape as a transformers Llama (a Gemma 3 for a gemma3 shape) with random bf16 weights and PEFT
    adapters a0, a1, ... (r = rank, alpha = 2 r, on all seven projections, random B so that they matter): the
    baseline, and what bench/e2e.py saves as a checkpoint."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    common = dict(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
                  num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                  vocab_size=cfg.vocab, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=True,
                  attn_implementation="sdpa")
    if cfg.arch == "gemma3":
        hcfg = tf.Gemma3TextConfig(**common, max_position_embeddings=32768, sliding_window=cfg.sliding_window,
                                   layer_types=["sliding_attention" if cfg.window(i) else "full_attention"
                                                for i in range(cfg.layers)],
                                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                                    "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                                   query_pre_attn_scalar=256)
        build = tf.Gemma3ForCausalLM
    else:
        hcfg = tf.LlamaConfig(**common, max_position_embeddings=131072,
                              rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                               "original_max_position_embeddings": 8192})
        build = tf.LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        torch.set_default_dtype(torch.bfloat16)
        model = build(hcfg)
        torch.set_default_dtype(torch.float32)
    lcfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                   "gate_proj", "up_proj", "down_proj"],
                      init_lora_weights=False)
    model = get_peft_model(model, lcfg, adapter_name="a0")
    for a in range(1, n_adapters):
        model.add_adapter(f"a{a}", lcfg)
    return model
