"""Read Hugging Face checkpoints: safetensors only (one file or sharded), plain or FP8 compressed-tensors."""
from __future__ import annotations

import hashlib
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from policyscan.engine.config import PROJECTIONS, ModelConfig
from policyscan.engine.errors import CheckpointError
from policyscan.engine.files import cached_sha256

PICKLE_NAMES = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
# besides the weights: what shapes the prompt (tokenizer, chat template) or the tensors' meaning (config)
SCORED_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.json")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def weight_name(layer: int, proj: str) -> str:
    part = "self_attn" if proj in ATTN else "mlp"
    return f"model.layers.{layer}.{part}.{proj}"


@dataclass(frozen=True)
class Checkpoint:
    """Where each tensor of a model directory lives; tensors are read on demand, once."""

    model_dir: Path
    config: ModelConfig
    files: dict[str, Path]  # tensor name -> file
    fp8: bool

    @classmethod
    def open(cls, model_dir: str | Path) -> "Checkpoint":
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model directory not found; pass --model DIR or set POLICYSCAN_MODEL")
        config = ModelConfig.from_dir(model_dir)
        files = _tensor_files(model_dir)
        qc = json.loads((model_dir / "config.json").read_text()).get("quantization_config")
        fp8 = qc is not None
        if fp8:
            _check_fp8_config(qc, model_dir / "config.json")
        ckpt = cls(model_dir, config, files, fp8)
        ckpt._check_complete()
        return ckpt

    def _check_complete(self) -> None:
        need = ["model.embed_tokens.weight", "model.norm.weight"]
        if not self.config.tie_embeddings:
            need.append("lm_head.weight")
        for i in range(self.config.layers):
            need += [f"model.layers.{i}.input_layernorm.weight", f"model.layers.{i}.post_attention_layernorm.weight"]
            need += [weight_name(i, p) + ".weight" for p in PROJECTIONS]
            if self.fp8:
                need += [weight_name(i, p) + ".weight_scale" for p in PROJECTIONS]
        missing = [n for n in need if n not in self.files]
        if missing:
            raise CheckpointError(
                f"{self.model_dir}: {len(missing)} tensors missing from the safetensors files, "
                f"first {missing[0]!r}; is this a complete {self.config.arch} checkpoint?")

    def get(self, name: str) -> torch.Tensor:
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found in the checkpoint")
        with safe_open(path, framework="pt") as f:
            return f.get_tensor(name)

    def get_rows(self, name: str, rows: list[int]) -> torch.Tensor:
        """Some rows of a 2-D tensor, read without loading the rest (the two label rows of a 128k vocabulary)."""
        path = self.files.get(name)
        if path is None:
            raise CheckpointError(f"{self.model_dir}: tensor {name!r} not found in the checkpoint")
        with safe_open(path, framework="pt") as f:
            sl = f.get_slice(name)
            return torch.cat([sl[r:r + 1] for r in rows])

    def fingerprint(self, fresh: bool = False) -> str:
        """sha256 over what decides a score: config, weights, tokenizer and chat templates (file_hashes)."""
        h = hashlib.sha256()
        for name, sha in sorted(self.file_hashes(fresh).items()):
            h.update(f"{name}\0{sha}\n".encode())
        return h.hexdigest()

    def file_hashes(self, fresh: bool = False) -> dict[str, str]:
        """sha256 of each file that decides a score, by its name in the model directory; fresh: every file read
        again, nothing taken from the digest cache (files.cached_sha256)."""
        jinja = [*self.model_dir.glob("*.jinja"), *self.model_dir.glob("additional_chat_templates/*.jinja")]
        paths = set(self.files.values()) | {p for p in jinja if p.is_file()}
        paths |= {self.model_dir / n for n in SCORED_FILES if (self.model_dir / n).is_file()}
        paths = sorted(paths)
        # the shards in parallel (hashlib and reads release the GIL): a fresh machine's first W1 run waited 6.7 s
        with ThreadPoolExecutor(min(8, len(paths) or 1)) as pool:
            digests = list(pool.map(lambda p: cached_sha256(p, fresh), paths))
        return {str(p.relative_to(self.model_dir)): d for p, d in zip(paths, digests)}


def _tensor_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = {name: model_dir / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index}: names shard {path.name}, which is not in {model_dir}")
        return files
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        pickles = [n for n in PICKLE_NAMES if (model_dir / n).exists()]
        hint = (f" It has {pickles[0]}, a pickle file, which policyscan never loads (pickle runs code): "
                "convert it with transformers' save_pretrained(..., safe_serialization=True).") if pickles else ""
        raise CheckpointError(f"{model_dir}: no *.safetensors weights.{hint}")
    files: dict[str, Path] = {}
    for path in shards:
        try:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    files[name] = path
        except Exception as e:  # safetensors raises its own error types for a bad header
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from e
    return files


def _check_fp8_config(qc: dict, where: Path) -> None:
    """Accept the compressed-tensors FP8_DYNAMIC layout: e4m3 weights, per-channel scales, dynamic per-token acts."""
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quantization {qc.get('quant_method')!r} is not supported; "
                              "policyscan reads compressed-tensors FP8 (policyscan quantize writes it)")
    for group in qc.get("config_groups", {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") != "channel":
            raise CheckpointError(f"{where}: only FP8 e4m3 weights with per-channel scales are supported, got {w}")
