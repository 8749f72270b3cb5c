"""Read Hugging Face checkpoints: safetensors only (one file or sharded), plain or FP8 compressed-tensors."""
from __future__ import annotations

import hashlib
import re
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from policyscan.engine.errors import CheckpointError
from policyscan.engine.files import cached_sha256
from policyscan.engine.json_schema import INDEX, load
from policyscan.engine.model.config import PROJECTIONS, ModelConfig, read_config
from policyscan.engine.tensor_header import open_header

PICKLE_NAMES = ("pytorch_model.bin", "model.bin", "pytorch_model.bin.index.json", "model.pt", "model.pth")
# besides the weights: what shapes the prompt (tokenizer, chat template) or the tensors' meaning (config)
SCORED_FILES = ("config.json", "model.safetensors.index.json", "tokenizer.json", "tokenizer_config.json",
                "chat_template.json")
ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
FLOATS = ("F32", "BF16", "F16", "F64")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
Dims = tuple[tuple[int, str], ...]  # a tensor's expected shape: each size with the config fields that give it


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
        """The directory's config.json checked (types, ranges), then against its tensors' shapes and dtypes (from
        the safetensors headers, no weight read)."""
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise CheckpointError(f"{model_dir}: model directory not found; pass --model DIR or set POLICYSCAN_MODEL")
        raw = read_config(model_dir)
        config = ModelConfig.from_dict(raw, source=str(model_dir / "config.json"))
        qc = raw.get("quantization_config")
        fp8 = qc is not None
        if fp8:
            _check_fp8_config(qc, model_dir / "config.json")
        files, layout = _tensor_files(model_dir)
        _check_tensors(config, fp8, files, layout, model_dir / "config.json")
        return cls(model_dir, config, files, fp8)

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
        # the shards in parallel (hashlib and reads release the GIL): one after another, a fresh run waited seconds
        with ThreadPoolExecutor(min(8, len(paths) or 1)) as pool:
            digests = list(pool.map(lambda p: cached_sha256(p, fresh), paths))
        return {str(p.relative_to(self.model_dir)): d for p, d in zip(paths, digests)}


def _tensor_files(model_dir: Path) -> tuple[dict[str, Path], dict[str, tuple[str, tuple[int, ...]]]]:
    """Each tensor's file, and its (dtype, shape) from the file's header."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        files = {name: model_dir / fname for name, fname in load(index, INDEX, CheckpointError)["weight_map"].items()}
        for path in set(files.values()):
            if not path.is_file():
                raise CheckpointError(f"{index}: names shard {path.name}, which is not in {model_dir}")
        shards = sorted(set(files.values()))
    else:
        shards = sorted(model_dir.glob("*.safetensors"))
        if not shards:
            pickles = [n for n in PICKLE_NAMES if (model_dir / n).exists()]
            hint = (f" It has {pickles[0]}, a pickle file, which policyscan never loads (pickle runs code): "
                    "convert it with transformers' save_pretrained(..., safe_serialization=True).") if pickles else ""
            raise CheckpointError(f"{model_dir}: no *.safetensors weights.{hint}")
        files = {}
    layout: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in shards:
        held = {name: (t.dtype, t.shape) for name, t in open_header(path, CheckpointError).tensors.items()}
        if index.is_file():
            mine = [name for name, p in files.items() if p == path]
            lost = [name for name in mine if name not in held]
            if lost:
                raise CheckpointError(f"{index}: names {len(lost)} tensors in {path.name} that it does not hold, "
                                      f"first {lost[0]!r}; the index and the shards do not belong together")
            layout.update((name, held[name]) for name in mine)
        else:
            files.update((name, path) for name in held)
            layout.update(held)
    return files, layout


def _check_fp8_config(qc: dict, where: Path) -> None:
    """Accept the compressed-tensors FP8_DYNAMIC layout: e4m3 weights, per-channel scales, dynamic per-token acts."""
    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{where}: quantization {qc.get('quant_method')!r} is not supported; "
                              "policyscan reads compressed-tensors FP8 (policyscan quantize writes it)")
    for group in (qc.get("config_groups") or {}).values():
        w = group.get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float" or w.get("strategy") != "channel":
            raise CheckpointError(f"{where}: only FP8 e4m3 weights with per-channel scales are supported, got {w}")


def _check_tensors(cfg: ModelConfig, fp8: bool, files: dict[str, Path], layout: dict[str, tuple[str, tuple[int, ...]]],
                   config_path: Path) -> None:
    """config.json must describe the tensors: as many layers, every tensor the loader reads there with the shape
    the config gives it, no tensor the config leaves out (it would go unread), floating-point dtypes (e4m3 for an
    FP8 checkpoint's projections). A config that disagrees would score with part of the model, or read past a
    table's end; the message names the config field, its value and the tensor."""
    layers = sorted({int(m.group(1)) for name in layout if (m := _LAYER.match(name))})
    if layers and layers[-1] >= cfg.layers:
        name = next(n for n in layout if n.startswith(f"model.layers.{layers[-1]}."))
        raise CheckpointError(f"{config_path}: num_hidden_layers is {cfg.layers}, but {files[name].name} holds "
                              f"tensors of {len(layers)} layers, up to model.layers.{layers[-1]} ({name!r}); use "
                              "the config.json that came with these weights")
    absent = sorted(set(range(cfg.layers)) - set(layers))
    if absent:
        raise CheckpointError(f"{config_path}: num_hidden_layers is {cfg.layers}, but the safetensors files hold no "
                              f"tensor of model.layers.{absent[0]} ({len(layers)} layers in all); is the checkpoint "
                              "complete, and is this its config.json?")
    need, extra = _expected_tensors(cfg, fp8)
    missing = [n for n in need if n not in layout]
    if missing:
        raise CheckpointError(
            f"{config_path.parent}: {len(missing)} tensors missing from the safetensors files, first {missing[0]!r}; "
            f"{_missing_hint(missing[0], cfg)}")
    for name, dims in [*need.items(), *((n, d) for n, d in extra.items() if n in layout and d is not None)]:
        _check_shape(name, layout[name][1], dims, files[name], config_path)
    unread = [n for n in layout if n not in need and n not in extra]
    if unread:
        raise CheckpointError(f"{files[unread[0]]}: tensor {unread[0]!r} is not part of the model config.json "
                              f"describes ({len(unread)} such tensors); {_unread_hint(unread[0], cfg)}")
    for name, (dtype, _) in layout.items():
        projection = name.endswith(".weight") and name.rsplit(".", 2)[-2] in PROJECTIONS
        want = ("F8_E4M3",) if fp8 and projection else FLOATS
        if dtype not in want:
            raise CheckpointError(f"{files[name]}: tensor {name!r} is {dtype}; {_dtype_hint(dtype, fp8, projection)}")


def _expected_tensors(cfg: ModelConfig, fp8: bool) -> tuple[dict[str, Dims], dict[str, Dims | None]]:
    """What the loader reads, by name, with the shape the config gives each; and the tensors it may read or
    leaves alone (o_proj's bias, a tied model's lm_head, stored rotary tables: None, any shape)."""
    hid, inter = (cfg.hidden, f"hidden_size is {cfg.hidden}"), (cfg.intermediate,
                                                                 f"intermediate_size is {cfg.intermediate}")
    vocab, head = (cfg.vocab, f"vocab_size is {cfg.vocab}"), (cfg.head_dim, f"head_dim is {cfg.head_dim}")
    q = (cfg.q_size, f"num_attention_heads x head_dim is {cfg.heads} x {cfg.head_dim} = {cfg.q_size}")
    kv = (cfg.kv_size, f"num_key_value_heads x head_dim is {cfg.kv_heads} x {cfg.head_dim} = {cfg.kv_size}")
    shapes = {"q_proj": (q, hid), "k_proj": (kv, hid), "v_proj": (kv, hid), "o_proj": (hid, q),
              "gate_proj": (inter, hid), "up_proj": (inter, hid), "down_proj": (hid, inter)}
    need: dict[str, Dims] = {"model.embed_tokens.weight": (vocab, hid), "model.norm.weight": (hid,)}
    extra: dict[str, Dims | None] = {}
    # tied, the head is the embedding, as in HF; a copy of it some tools save beside is left unread
    (extra if cfg.tie_embeddings else need)["lm_head.weight"] = (vocab, hid)
    norms = ["input_layernorm", "post_attention_layernorm"] + (
        ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if cfg.gemma else [])
    for i in range(cfg.layers):
        pre = f"model.layers.{i}."
        need.update({f"{pre}{n}.weight": (hid,) for n in norms})
        if cfg.qk_norm:
            need.update({f"{pre}self_attn.{n}.weight": (head,) for n in ("q_norm", "k_norm")})
        for proj, dims in shapes.items():
            need[weight_name(i, proj) + ".weight"] = dims
            if fp8:
                need[weight_name(i, proj) + ".weight_scale"] = dims[:1]
        if cfg.qkv_bias:
            need.update({weight_name(i, p) + ".bias": shapes[p][:1] for p in ("q_proj", "k_proj", "v_proj")})
        extra[weight_name(i, "o_proj") + ".bias"] = (hid,)
        extra.update({f"{pre}self_attn.rotary_emb.{t}": None for t in ("inv_freq", "cos_cached", "sin_cached")})
    return need, extra


def _check_shape(name: str, shape: tuple[int, ...], dims: Dims, path: Path, config_path: Path) -> None:
    if name.endswith(".weight_scale") and len(shape) == 2 and shape[1] == 1:
        shape = shape[:1]  # a column of per-channel scales, as compressed-tensors writes them
    if len(shape) != len(dims):
        raise CheckpointError(f"{path}: tensor {name!r} has shape {list(shape)}, where config.json "
                              f"({config_path}) gives {[d for d, _ in dims]}; the file is not this model's")
    for axis, (got, (want, field)) in enumerate(zip(shape, dims)):
        if got != want:
            what = "entries" if len(dims) == 1 else ("rows", "columns")[axis]
            raise CheckpointError(f"{config_path}: {field}, but {name} in {path.name} has {got} {what} (shape "
                                  f"{list(shape)}); use the config.json that came with these weights")


def _missing_hint(name: str, cfg: ModelConfig) -> str:
    if name == "lm_head.weight":
        return ("config.json's tie_word_embeddings is false (or absent), so the head is lm_head.weight; set it to "
                "true if the head is the embedding")
    if name.endswith(".bias"):
        return ("config.json's attention_bias is true (or absent, for qwen2), so q, k and v have biases; set it to "
                "false if the model has none")
    if name.endswith(".weight_scale"):
        return ("config.json's quantization_config makes this an FP8 checkpoint, whose projections carry "
                "weight_scale; remove it if the weights are not FP8")
    if name.endswith(("q_norm.weight", "k_norm.weight", "feedforward_layernorm.weight")):
        return f"config.json's architectures make this a {cfg.arch} model, which has them: is it one?"
    return f"is this a complete {cfg.arch} checkpoint, and is config.json its own?"


def _unread_hint(name: str, cfg: ModelConfig) -> str:
    if name.endswith(("q_proj.bias", "k_proj.bias", "v_proj.bias")):
        return "attention_bias is false (or absent), so these biases would be dropped; set it to true"
    if name.endswith(".input_scale"):
        return ("static activation scales, which policyscan does not apply (it quantizes activations per token); "
                "quantize the model with `policyscan quantize` or as FP8_DYNAMIC")
    return f"policyscan would not read it: is this checkpoint the {cfg.arch} model config.json says it is?"


def _dtype_hint(dtype: str, fp8: bool, projection: bool) -> str:
    if fp8 and projection:
        return "config.json's quantization_config makes this an FP8 checkpoint, whose projection weights are F8_E4M3"
    if dtype == "F8_E4M3" and not fp8:
        return ("config.json has no quantization_config, so FP8 weights would be read as they are; an FP8 "
                "checkpoint's config.json says how it was quantized (compressed-tensors)")
    return f"the model's weights and norms must be floating point ({', '.join(FLOATS)})"
