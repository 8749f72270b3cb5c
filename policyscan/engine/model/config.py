"""Model configuration: what the decoder needs from a Hugging Face `config.json`."""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from policyscan.engine.errors import CheckpointError
from policyscan.engine.json_schema import CONFIG, check, read_json

# Architectures whose HF definitions differ only in the switches below.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "GraniteForCausalLM": "granite",
}
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class RopeConfig:
    theta: float
    kind: str = "default"  # "default" | "linear" | "llama3"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        if self.kind not in ("default", "linear", "llama3"):
            raise CheckpointError(
                f"rope_scaling type {self.kind!r} is not supported (supported: none, linear, llama3)")
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise CheckpointError(f"rope {name} must be positive and finite, got {getattr(self, name)}")
        if self.kind == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise CheckpointError(f"rope high_freq_factor {self.high_freq_factor} must be greater than "
                                  f"low_freq_factor {self.low_freq_factor} (llama3 scaling divides by their "
                                  "difference)")


@dataclass(frozen=True)
class ModelConfig:
    arch: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    rms_eps: float
    rope: RopeConfig
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None
    max_position: int = 131072
    sliding_layers: tuple[bool, ...] | None = None  # gemma2/3: which layers slide (None: all, with a window)
    sliding_rope: RopeConfig | None = None  # gemma3: the sliding layers' own rope (None: `rope` for every layer)
    attn_scale: float | None = None    # softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # gemma2: scores = cap * tanh(scores / cap) before the mask
    final_softcap: float | None = None  # gemma2: each label logit capped the same way
    embed_scale: float = 1.0      # gemma2/3 sqrt(hidden), granite embedding_multiplier
    residual_scale: float = 1.0   # granite: each residual branch times this before the add
    logits_scale: float = 1.0     # granite: logits divided by this

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES.values():
            raise CheckpointError(f"unknown architecture {self.arch!r}")
        if self.sliding_layers is not None and len(self.sliding_layers) != self.layers:
            raise CheckpointError(f"layer_types has {len(self.sliding_layers)} entries for {self.layers} layers "
                                  "(num_hidden_layers)")
        for name in ("attn_scale", "attn_softcap", "final_softcap", "embed_scale", "residual_scale",
                     "logits_scale"):
            v = getattr(self, name)
            if v is not None and not (math.isfinite(v) and v > 0):
                raise CheckpointError(f"{_FIELD_NAMES[name]} must be positive and finite, got {v}")
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"{name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise CheckpointError(
                f"num_attention_heads {self.heads} is not a multiple of num_key_value_heads {self.kv_heads}")
        if self.head_dim % 2:
            raise CheckpointError(f"head_dim {self.head_dim} must be even: rotary embeddings turn its two halves "
                                  "(without a head_dim field it is hidden_size / num_attention_heads)")

    @property
    def gemma(self) -> bool:
        """(1 + w) RMSNorms, a norm after attention and after the MLP, GELU-tanh: gemma2's and gemma3's layer."""
        return self.arch in ("gemma2", "gemma3")

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    def prompt_length(self, max_length: int) -> int:
        """Tokens a prompt may take: --max-length, or the model's positions (max_position_embeddings) when fewer.
        Past them a prompt would be read at positions the model never saw, so it is cut there, and counted as cut."""
        return min(max_length, self.max_position)

    def batch_too_small(self, batch_tokens: int, max_length: int) -> str | None:
        """Why a packed batch of batch_tokens tokens cannot hold a whole prompt, or None when it can. The bound is
        the length prompts are cut at, so a --max-length above the model's positions asks no more of the batch."""
        need = self.prompt_length(max_length)
        if batch_tokens >= need:
            return None
        bound = (f"--max-length ({max_length})" if need == max_length else
                 f"the {need} tokens a prompt may take (the model's max_position_embeddings, below --max-length "
                 f"{max_length})")
        return f"--batch-tokens ({batch_tokens}) must be at least {bound}: a whole prompt must fit in one batch"

    def window(self, layer: int) -> int | None:
        """The sliding window of one layer's attention, None for full attention."""
        if self.sliding_layers is not None and not self.sliding_layers[layer]:
            return None
        return self.sliding_window

    @property
    def ropes(self) -> tuple[RopeConfig, ...]:
        """The distinct rotary embeddings of the layers: `rope`, then gemma3's sliding layers' own."""
        return (self.rope,) if self.sliding_rope in (None, self.rope) else (self.rope, self.sliding_rope)

    def rope_index(self, layer: int) -> int:
        """Which of `ropes` rotates one layer's q and k."""
        return int(len(self.ropes) > 1 and self.sliding_layers is not None and self.sliding_layers[layer])

    @property
    def q_size(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.kv_heads * self.head_dim

    def proj_shape(self, proj: str) -> tuple[int, int]:
        """(out_features, in_features) of one base projection."""
        h, i = self.hidden, self.intermediate
        return {
            "q_proj": (self.q_size, h), "k_proj": (self.kv_size, h), "v_proj": (self.kv_size, h),
            "o_proj": (h, self.q_size), "gate_proj": (i, h), "up_proj": (i, h), "down_proj": (h, i),
        }[proj]

    @classmethod
    def from_dict(cls, raw: object, source: str = "config.json") -> "ModelConfig":
        """A config.json's fields, checked against CONFIG first (types and ranges, every field named)."""
        check(raw, CONFIG, source, CheckpointError)
        archs = raw.get("architectures") or []
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not known:
            raise CheckpointError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"policyscan runs {', '.join(ARCHITECTURES)}")
        arch = known[0]
        _refuse_unsupported(raw, arch, source)
        try:
            hidden, heads = raw["hidden_size"], raw["num_attention_heads"]
            if arch in ("gemma2", "gemma3"):  # no use_sliding_window switch: layer_types says which layers slide
                window = raw.get("sliding_window", 4096)
            else:
                window = raw.get("sliding_window") if _flag(raw, "use_sliding_window", arch == "mistral") else None
            extra = _gemma2(raw, hidden) if arch == "gemma2" else _gemma3(raw, hidden) if arch == "gemma3" \
                else _granite(raw) if arch == "granite" else {}
            rope = extra.pop("rope", None) or _rope(raw)  # gemma3: its full-attention layers' rope
            kv_heads, head_dim = (4, 256) if arch == "gemma3" else (heads, hidden // heads)  # HF's defaults
            return cls(
                arch=arch, hidden=hidden, intermediate=raw["intermediate_size"], layers=raw["num_hidden_layers"],
                heads=heads, kv_heads=raw.get("num_key_value_heads") or kv_heads,
                head_dim=raw.get("head_dim") or head_dim, vocab=raw["vocab_size"],
                rms_eps=float(raw.get("rms_norm_eps", 1e-6)), rope=rope,
                tie_embeddings=_flag(raw, "tie_word_embeddings", arch in ("gemma2", "gemma3")),
                qkv_bias=_flag(raw, "attention_bias", arch == "qwen2"), qk_norm=arch in ("qwen3", "gemma3"),
                sliding_window=window or None, max_position=raw.get("max_position_embeddings", 131072), **extra,
            )
        except CheckpointError as e:
            raise CheckpointError(f"{source}: {e}") from e


def read_config(model_dir: Path) -> object:
    """A model directory's config.json, parsed (ModelConfig.from_dict checks it)."""
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise CheckpointError(f"{path}: no config.json; --model must be a Hugging Face model directory")
    return read_json(path, CheckpointError)


# ModelConfig field -> the config.json key it comes from, for messages
_FIELD_NAMES = {"attn_scale": "query_pre_attn_scalar / attention_multiplier",
                "attn_softcap": "attn_logit_softcapping", "final_softcap": "final_logit_softcapping",
                "embed_scale": "embedding_multiplier", "residual_scale": "residual_multiplier",
                "logits_scale": "logits_scaling"}
LAYER_TYPES = {"sliding_attention": True, "full_attention": False}


def _refuse_unsupported(raw: dict, arch: str, source: str) -> None:
    """Fields whose other values change the model in ways policyscan does not implement: refused by name."""
    gemma = arch in ("gemma2", "gemma3")
    act_key, act = ("hidden_activation", "gelu_pytorch_tanh") if gemma else ("hidden_act", "silu")
    if raw.get(act_key, act) != act:
        raise CheckpointError(f"{source}: {act_key} {raw[act_key]!r} is not supported for {arch} (only {act!r})")
    flags = ["mlp_bias"] + (["attention_bias", "use_bidirectional_attention"] if gemma or arch == "granite"
                            else [])
    for key in flags:
        if raw.get(key):
            raise CheckpointError(f"{source}: {key} = {raw[key]!r} is not supported for {arch}")
    if arch == "gemma3" and raw.get("attn_logit_softcapping") is not None:
        raise CheckpointError(f"{source}: attn_logit_softcapping = {raw['attn_logit_softcapping']!r} is not supported "
                              "for gemma3: transformers' Gemma3 never applies it (Gemma 3 norms q and k instead), so "
                              "what it would mean is unknown; set it to null")


def _flag(raw: dict, key: str, default: bool) -> bool:
    """A true/false field; missing or null: HF's default."""
    value = raw.get(key)
    return default if value is None else value


def _gemma2(raw: dict, hidden: int) -> dict:
    """HF's defaults where a key is missing; a key set to null turns its soft-capping off."""
    n = raw["num_hidden_layers"]
    types = raw.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    return dict(sliding_layers=_sliding_layers(types), attn_scale=scalar ** -0.5,
                attn_softcap=_opt(raw.get("attn_logit_softcapping", 50.0)),
                final_softcap=_opt(raw.get("final_logit_softcapping", 30.0)), embed_scale=hidden ** 0.5)


def _gemma3(raw: dict, hidden: int) -> dict:
    """gemma2's fields with gemma3's defaults (five sliding layers, then a full one; the logits soft-capped only where
    final_logit_softcapping is set, attention never: _refuse_unsupported), and a rope per layer type:
    `rope_parameters` {"full_attention": ..., "sliding_attention": ...}, or in older configs `rope_theta` (with
    `rope_scaling`) for full attention and `rope_local_base_freq` for sliding, as transformers reads them."""
    n, every = raw["num_hidden_layers"], raw.get("sliding_window_pattern") or 6
    types = raw.get("layer_types") or ["sliding_attention" if (i + 1) % every else "full_attention" for i in range(n)]
    params = raw.get("rope_parameters") or {}
    flat = sorted(set(params) - set(LAYER_TYPES))
    if flat:
        raise CheckpointError(f"rope_parameters has {flat} beside the layer types: gemma3 takes one rope per "
                              f"layer type ({{\"full_attention\": {{...}}, \"sliding_attention\": {{...}}}})")
    full = {**(params.get("full_attention") or {}), **(raw.get("rope_scaling") or {})}
    local = dict(params.get("sliding_attention") or {})
    full.setdefault("rope_theta", raw.get("rope_theta") or 1e6)
    local.setdefault("rope_theta", raw.get("rope_local_base_freq") or 1e4)
    scalar = float(raw.get("query_pre_attn_scalar", 256))
    return dict(sliding_layers=_sliding_layers(types), attn_scale=scalar ** -0.5,
                final_softcap=_opt(raw.get("final_logit_softcapping")), embed_scale=hidden ** 0.5,
                rope=_rope_of(full), sliding_rope=_rope_of(local))


def _sliding_layers(types: list[str]) -> tuple[bool, ...]:
    if any(t not in LAYER_TYPES for t in types):
        raise CheckpointError(f"layer_types {sorted(set(types) - set(LAYER_TYPES))} are not supported "
                              f"(supported: {', '.join(LAYER_TYPES)})")
    return tuple(LAYER_TYPES[t] for t in types)


def _granite(raw: dict) -> dict:
    return dict(attn_scale=float(raw.get("attention_multiplier", 1.0)),
                embed_scale=float(raw.get("embedding_multiplier", 1.0)),
                residual_scale=float(raw.get("residual_multiplier", 1.0)),
                logits_scale=float(raw.get("logits_scaling", 1.0)))


def _opt(v) -> float | None:
    return float(v) if v is not None else None


def _rope(raw: dict) -> RopeConfig:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    return _rope_of(scaling, raw.get("rope_theta"))


def _rope_of(scaling: dict, theta: float | None = None) -> RopeConfig:
    """One rope from its parameters (rope_type, rope_theta, the scaling's fields); `theta` first where given."""
    theta = float(theta or scaling.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta, kind=kind, factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def inv_freq(cfg: ModelConfig, rope: RopeConfig | None = None):
    """Rotary inverse frequencies (float64) of `rope` (one of cfg.ropes; default cfg.rope), including linear and
    llama3 scaling as HF computes them."""
    import torch

    r = rope or cfg.rope
    freq = 1.0 / (r.theta ** (torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim))
    if r.kind == "linear":
        return freq / r.factor
    if r.kind == "llama3":
        low_wavelen = r.original_max_position / r.low_freq_factor
        high_wavelen = r.original_max_position / r.high_freq_factor
        wavelen = 2 * math.pi / freq
        scaled = torch.where(wavelen > low_wavelen, freq / r.factor, freq)
        smooth = (r.original_max_position / wavelen - r.low_freq_factor) / (r.high_freq_factor - r.low_freq_factor)
        smoothed = (1 - smooth) * scaled / r.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return freq
