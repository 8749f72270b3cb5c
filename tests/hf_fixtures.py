"""Tiny random Hugging Face checkpoints and PEFT policy bundles, and HF + PEFT reference scores."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

ODD = dict(hidden_size=96, intermediate_size=200, num_hidden_layers=3, num_attention_heads=6,
           num_key_value_heads=2, vocab_size=211, max_position_embeddings=512, rms_norm_eps=1e-5)


def hf_config(arch: str, tie: bool = False, **over):
    import transformers as tf

    kw = dict(ODD, tie_word_embeddings=tie, **over)
    if arch == "llama":
        kw.setdefault("rope_parameters", {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 64})
        return tf.LlamaConfig(**kw)
    if arch == "mistral":
        kw.setdefault("sliding_window", 9)  # shorter than the longest test sequence: the window matters
        return tf.MistralConfig(**kw)
    if arch == "qwen2":
        return tf.Qwen2Config(**kw)
    if arch == "qwen3":
        kw.setdefault("head_dim", 20)  # heads * head_dim != hidden, as in real Qwen3 models
        return tf.Qwen3Config(**kw)
    if arch == "gemma2":  # small caps and window, so that soft-capping and the window matter at these sizes
        for key, value in dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=9, attn_logit_softcapping=2.0,
                               final_logit_softcapping=3.0).items():
            kw.setdefault(key, value)
        return tf.Gemma2Config(**kw)
    if arch == "gemma3":  # both layer types, a rope of each (linear scaling on full attention, as the 4B+ have it),
        # a window shorter than the longest test sequence; no soft-capping (gemma3's default)
        for key, value in dict(head_dim=20, query_pre_attn_scalar=24, sliding_window=9,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                               rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0,
                                                                   "rope_theta": 1e6},
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
                               ).items():
            kw.setdefault(key, value)
        return tf.Gemma3TextConfig(**kw)
    if arch == "granite":  # multipliers far from 1, as in the real models
        for key, value in dict(embedding_multiplier=12.0, attention_multiplier=0.09, residual_multiplier=0.22,
                               logits_scaling=1.7).items():
            kw.setdefault(key, value)
        return tf.GraniteConfig(**kw)
    raise ValueError(arch)


def make_model(path: Path, arch: str, tie: bool = False, seed: int = 0, shard: str | None = None, **over):
    import transformers as tf

    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(hf_config(arch, tie, **over), dtype=torch.float32)
    with torch.no_grad():  # random norms and biases too, so a skipped norm weight or bias shows
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    kw = {"max_shard_size": shard} if shard else {}
    model.save_pretrained(path, **kw)
    return model


@dataclass(frozen=True)
class AdapterSpec:
    r: int
    targets: tuple[str, ...]
    alpha: float = 16.0
    rslora: bool = False


ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = [
    AdapterSpec(1, ("q_proj", "v_proj")),
    AdapterSpec(8, ALL, 32.0, True),
    AdapterSpec(5, ("k_proj", "o_proj", "down_proj", "up_proj"), 7.0),
]
# ranks whose stacks pass 64: q + k + v = 64 + 32 + 32 = 128, gate + up = 64, o = 64, down = 64
WIDE_SPECS = [
    AdapterSpec(32, ALL, 64.0),
    AdapterSpec(64, ("q_proj", "o_proj", "down_proj"), 32.0, True),
    AdapterSpec(3, ("v_proj",)),
]


def make_policy(base_model, path: Path, name: str, spec: AdapterSpec, seed: int, compliant: int = 3,
                violation: int = 7) -> None:
    """A PEFT adapter with random A and B (B not zero), and a policy.json naming two label token ids."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    cfg = LoraConfig(r=spec.r, lora_alpha=spec.alpha, target_modules=list(spec.targets), use_rslora=spec.rslora,
                     init_lora_weights=False, lora_dropout=0.0)
    peft_model = get_peft_model(base_model, cfg)
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_" in n:
                p.mul_(0.5)  # adapters that move f by about as much as the base model's own spread
    peft_model.save_pretrained(path)
    peft_model.unload()  # restore base_model for the next adapter
    (path / "policy.json").write_text(json.dumps({
        "name": name, "labels": {"compliant": f"<{compliant}>", "violation": f"<{violation}>"}}))


def make_bundle(root: Path, arch: str, prefix: str = "p", seed: int = 0, specs: list[AdapterSpec] | None = None,
                **model_kw) -> list[Path]:
    """root/model of `arch` and one policy per spec (SPECS by default; root/<prefix>0 ...); returns the policy
    dirs."""
    model = make_model(root / "model", arch, **model_kw)
    dirs = []
    for i, spec in enumerate(specs or SPECS):
        make_policy(model, root / f"{prefix}{i}", f"{prefix}{i}", spec, seed=seed + i)
        dirs.append(root / f"{prefix}{i}")
    return dirs


def hf_scores(model_dir: Path, policy_dirs: list[Path], seqs: list[list[int]], adapters: list[int],
              label_ids: list[tuple[int, int]], dtype: torch.dtype, device: str = "cpu") -> torch.Tensor:
    """f per sequence from transformers + PEFT, one sequence at a time (no padding), in `dtype`."""
    import transformers as tf
    from peft import PeftModel

    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager").to(device)
    model = PeftModel.from_pretrained(base, policy_dirs[0], adapter_name="p0")
    for i, d in enumerate(policy_dirs[1:], 1):
        model.load_adapter(d, adapter_name=f"p{i}")
    model.eval()
    out = []
    with torch.no_grad():
        for ids, a in zip(seqs, adapters):
            model.set_adapter(f"p{a}")
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].double().cpu()
            c, v = label_ids[a]
            out.append(logits[v] - logits[c])
    del model, base
    return torch.stack(out)


def write_policies(root: Path, cfg, n: int, seed: int = 0, template: dict | None = None) -> list[Path]:
    """n PEFT LoRA bundles written straight as safetensors (hundreds in seconds, where get_peft_model takes a
    second each): ranks cycle through 1-32, some on all seven projections, some on a few; random A and B."""
    from safetensors.torch import save_file

    ranks = (16, 1, 8, 32, 5, 16, 3, 24)
    shapes = {"q_proj": (cfg.num_attention_heads * cfg.head_dim, cfg.hidden_size),
              "k_proj": (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size),
              "v_proj": (cfg.num_key_value_heads * cfg.head_dim, cfg.hidden_size),
              "o_proj": (cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim),
              "gate_proj": (cfg.intermediate_size, cfg.hidden_size),
              "up_proj": (cfg.intermediate_size, cfg.hidden_size),
              "down_proj": (cfg.hidden_size, cfg.intermediate_size)}
    g = torch.Generator().manual_seed(seed)
    dirs = []
    for i in range(n):
        r = ranks[i % len(ranks)]
        targets = ALL if i % 3 else ("q_proj", "v_proj", "down_proj")
        tensors = {}
        for layer in range(cfg.num_hidden_layers):
            for proj in targets:
                out, k = shapes[proj]
                block = "self_attn" if proj[0] in "qkvo" else "mlp"
                key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) * k ** -0.5
                tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.5 * r ** -0.5
        d = root / f"pol{i:03d}"
        d.mkdir(parents=True)
        save_file(tensors, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": r, "lora_alpha": 2 * r, "target_modules": list(targets),
            "use_rslora": False, "fan_in_fan_out": False, "bias": "none"}))
        (d / "policy.json").write_text(json.dumps({
            "name": f"pol{i:03d}", "labels": {"compliant": " Compliant", "violation": " Violation"},
            **({"template": template} if template else {})}))
        dirs.append(d)
    return dirs
