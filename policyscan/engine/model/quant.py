"""FP8 e4m3 weights with per-output-channel scales, and `policyscan quantize` (compressed-tensors layout)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from policyscan.engine.errors import CheckpointError
from policyscan.engine.model.checkpoint import Checkpoint, weight_name
from policyscan.engine.model.config import PROJECTIONS
from policyscan.kernels.reference import FP8, FP8_MAX

# What llm-compressor writes for its FP8_DYNAMIC scheme, so vLLM and others load our output too.
FP8_DYNAMIC_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "float-quantized",
    "quantization_status": "compressed",
    "kv_cache_scheme": None,
    "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False,
                    "group_size": None, "block_structure": None, "actorder": None, "observer": "minmax",
                    "observer_kwargs": {}},
        "input_activations": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                              "dynamic": True, "group_size": None, "block_structure": None, "actorder": None,
                              "observer": None, "observer_kwargs": {}},
        "output_activations": None,
    }},
}


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel: scale = amax(|row|) / 448, w8 = round(w / scale) in e4m3. Returns (w8, scale fp32 [N])."""
    wf = w.float()
    amax = wf.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


def dequantize_weight(w8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return (w8.float() * scale.float().reshape(-1, 1)).to(dtype)


def quantize_checkpoint(model_dir: str | Path, out_dir: str | Path, shard_bytes: int = 4 << 30) -> Path:
    """Write an FP8_DYNAMIC compressed-tensors copy of a 16/32-bit checkpoint; tokenizer files are copied."""
    ckpt = Checkpoint.open(model_dir)
    if ckpt.fp8:
        raise CheckpointError(f"{model_dir}: already FP8 (config.json has a quantization_config)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    linear = {weight_name(i, p) + ".weight" for i in range(ckpt.config.layers) for p in PROJECTIONS}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(ckpt.files):
        t = ckpt.get(name)
        if name in linear:
            w8, scale = quantize_weight(t)
            tensors = {name: w8, name[: -len(".weight")] + ".weight_scale": scale[:, None].contiguous()}
        else:
            tensors = {name: t.contiguous()}
        nbytes = sum(v.numel() * v.element_size() for v in tensors.values())
        if size and size + nbytes > shard_bytes:
            shards.append({})
            size = 0
        shards[-1].update(tensors)
        size += nbytes
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    if len(shards) == 1:
        names = ["model.safetensors"]
    weight_map = {}
    for fname, tensors in zip(names, shards):
        save_file(tensors, out / fname, metadata={"format": "pt"})
        weight_map.update({k: fname for k in tensors})
    if len(shards) > 1:
        index = {"metadata": {}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = json.loads((ckpt.model_dir / "config.json").read_text())
    config["quantization_config"] = FP8_DYNAMIC_CONFIG
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ckpt.model_dir.iterdir():
        if extra.suffix in (".json", ".txt", ".model", ".jinja") and extra.name not in (
                "config.json", "model.safetensors.index.json"):
            shutil.copy2(extra, out / extra.name)
    return out
