"""Model configuration: what the decoder needs from a Hugging Face `config.json`."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

# Architectures whose HF definitions differ only in the switches below.
ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
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
        if self.theta <= 0 or self.factor <= 0:
            raise CheckpointError(f"rope theta and factor must be positive, got {self.theta}, {self.factor}")


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

    def __post_init__(self) -> None:
        if self.arch not in ARCHITECTURES.values():
            raise CheckpointError(f"unknown architecture {self.arch!r}")
        for name in ("hidden", "intermediate", "layers", "heads", "kv_heads", "head_dim", "vocab"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config.json: {name} must be positive, got {getattr(self, name)}")
        if self.heads % self.kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads {self.heads} is not a multiple of "
                f"num_key_value_heads {self.kv_heads}")

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
    def from_dir(cls, model_dir: Path) -> "ModelConfig":
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise CheckpointError(f"{path}: no config.json; --model must be a Hugging Face model directory")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{path}: not valid JSON ({e})") from e
        return cls.from_dict(raw, source=str(path))

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json") -> "ModelConfig":
        archs = raw.get("architectures") or []
        known = [ARCHITECTURES[a] for a in archs if a in ARCHITECTURES]
        if not known:
            raise CheckpointError(
                f"{source}: architecture {archs or raw.get('model_type')!r} is not supported; "
                f"policyscan runs {', '.join(ARCHITECTURES)}")
        arch = known[0]
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            rope = _rope(raw)
            window = raw.get("sliding_window") if raw.get("use_sliding_window", arch == "mistral") else None
            return cls(
                arch=arch, hidden=hidden, intermediate=int(raw["intermediate_size"]),
                layers=int(raw["num_hidden_layers"]), heads=heads,
                kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                vocab=int(raw["vocab_size"]), rms_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=rope, tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("attention_bias", arch == "qwen2")),
                qk_norm=arch == "qwen3", sliding_window=int(window) if window else None,
                max_position=int(raw.get("max_position_embeddings", 131072)),
            )
        except KeyError as e:
            raise CheckpointError(f"{source}: missing key {e.args[0]!r}") from e


def _rope(raw: dict) -> RopeConfig:
    scaling = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    theta = float(raw.get("rope_theta") or scaling.get("rope_theta") or 10000.0)
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta, kind=kind, factor=float(scaling.get("factor", 1.0)),
        low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
        high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
        original_max_position=int(scaling.get("original_max_position_embeddings", 8192)),
    )


def inv_freq(cfg: ModelConfig):
    """Rotary inverse frequencies (float64), including linear and llama3 scaling as HF computes them."""
    import torch

    r = cfg.rope
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
