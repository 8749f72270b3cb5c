"""Policy bundles: policy.json (labels, template, calibration, threshold) and a PEFT LoRA adapter, or no adapter
at all: a prompt-only policy scores the base model itself (zero-shot, or a fully fine-tuned guard model)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from policyscan.engine.errors import PolicyError
from policyscan.engine.files import cached_sha256
from policyscan.engine.json_schema import ADAPTER_CONFIG, POLICY, load
from policyscan.engine.model.config import PROJECTIONS, ModelConfig
from policyscan.engine.policy.tensor_file import TensorFile

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors", "adapter_model.bin")
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])(?:\.default)?\.weight$")


@dataclass(frozen=True)
class LoraWeights:
    """One adapter's factors: {(layer, proj): (A [r, in], B [out, r])}, float32, and each module's scale."""

    factors: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]
    scales: dict[tuple[int, str], float]

    def rank(self, layer: int, proj: str) -> int:
        ab = self.factors.get((layer, proj))
        return 0 if ab is None else ab[0].shape[0]


@dataclass(frozen=True)
class Policy:
    name: str
    path: Path
    compliant: str
    violation: str
    lora: LoraWeights  # no factors: a prompt-only policy
    adapter_sha256: str | None  # None: a prompt-only policy
    prefix: str = ""
    suffix: str = ""
    a: float = 1.0
    b: float = 0.0
    threshold: float = 0.5
    description: str = ""
    calibration: dict = field(default_factory=dict)
    chat_template: str | None = None  # plain, a file relative to the bundle, or a name of the model's templates

    def __post_init__(self) -> None:
        if self.chat_template is not None and (not isinstance(self.chat_template, str) or not self.chat_template):
            raise PolicyError(f"{self.path}/policy.json: chat_template must be a non-empty string (plain, a Jinja "
                              f"file in the bundle, or a name of the model's templates), got {self.chat_template!r}")
        if not re.fullmatch(r"[A-Za-z0-9_.-]+", self.name):
            raise PolicyError(f"{self.path}/policy.json: name {self.name!r} must be letters, digits, '_', '.', '-' "
                              "(it becomes the column p_<name>)")
        if not 0.0 < self.threshold < 1.0:
            raise PolicyError(f"{self.path}/policy.json: threshold must be in (0, 1), got {self.threshold}")
        if not (math.isfinite(self.a) and math.isfinite(self.b)):
            raise PolicyError(f"{self.path}/policy.json: calibration a, b must be finite, got {self.a}, {self.b}")

    def calibrate_np(self, f: np.ndarray) -> np.ndarray:
        """Platt: p = sigmoid(a*f + b), in float64, one element at a time: numpy's vectorized exp may take
        another path for an array's tail, and p must not depend on where its row sits."""
        z = (self.a * np.asarray(f, dtype=np.float64) + self.b).tolist()
        return np.array([1.0 / (1.0 + math.exp(-v)) if v > -700 else 0.0 for v in z], dtype=np.float64)


def load_policy(path: str | Path) -> Policy:
    path = Path(path)
    pj = path / "policy.json"
    if not pj.is_file():
        raise PolicyError(f"{path}: not a policy bundle (no policy.json); a bundle holds policy.json, and "
                          "adapter_config.json and adapter_model.safetensors unless it is prompt-only")
    meta = load(pj, POLICY, PolicyError)
    labels, template, calib = meta["labels"], meta.get("template") or {}, meta.get("calibration") or {}
    lora, sha = load_adapter(path)
    if meta.get("adapter") == "required" and sha is None:
        raise PolicyError(f"{path}: policy.json says the adapter is required, but the bundle has none of its files; "
                          "copy adapter_config.json and adapter_model.safetensors into it (without them it would "
                          "score the bare base model)")
    return Policy(
        name=meta["name"], path=path, compliant=labels["compliant"], violation=labels["violation"],
        lora=lora, adapter_sha256=sha, prefix=template.get("prefix", ""), suffix=template.get("suffix", ""),
        a=float(calib.get("a", 1.0)), b=float(calib.get("b", 0.0)), threshold=float(meta.get("threshold", 0.5)),
        description=meta.get("description", ""), calibration=calib, chat_template=meta.get("chat_template"),
    )


def load_adapter(path: Path) -> tuple[LoraWeights, str | None]:
    """The adapter's factors and the sha256 of its weights; none of its files: a prompt-only policy."""
    cfg_path, w_path, bin_path = (path / n for n in ADAPTER_FILES)
    if not any(p.exists() for p in (cfg_path, w_path, bin_path)):
        return LoraWeights({}, {}), None
    if not cfg_path.is_file() or not w_path.is_file():
        bin_hint = " (adapter_model.bin is a pickle file and is never loaded)" if bin_path.exists() else ""
        raise PolicyError(f"{path}: needs adapter_config.json and adapter_model.safetensors{bin_hint}, or none "
                          "of the adapter's files for a prompt-only policy")
    cfg = load(cfg_path, ADAPTER_CONFIG, PolicyError)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise PolicyError(f"{cfg_path}: peft_type {cfg.get('peft_type')!r}; only LoRA adapters are supported")
    for key in CHANGES_THE_PRODUCT:
        if cfg.get(key):
            raise PolicyError(f"{cfg_path}: {key}={cfg[key]} is not supported: it changes what PEFT computes from "
                              "the factors, which policyscan does not")
    if cfg.get("bias", "none") != "none":
        raise PolicyError(f"{cfg_path}: bias={cfg['bias']!r}; only bias='none' adapters are supported")
    if cfg.get("modules_to_save"):
        raise PolicyError(f"{cfg_path}: modules_to_save={cfg['modules_to_save']} would change base weights; "
                          "policyscan only applies LoRA factors")
    factors: dict[tuple[int, str], list] = {}
    modules: dict[tuple[int, str], str] = {}  # each factor's module path in the model PEFT wrapped
    weights = TensorFile(w_path)
    for name in weights.names:
        m = _KEY.search(name)
        if m is None or m.group(2) not in PROJECTIONS:
            raise PolicyError(f"{w_path}: tensor {name!r} is not a LoRA factor of "
                              f"{'/'.join(PROJECTIONS)}; policyscan cannot apply it")
        t = weights.float32(name)
        if t.ndim != 2:
            raise PolicyError(f"{w_path}: tensor {name!r} has shape {list(t.shape)}; a LoRA factor is a matrix")
        slot = factors.setdefault((int(m.group(1)), m.group(2)), [None, None])
        slot[0 if m.group(3) == "A" else 1] = _finite(t, w_path, name)
        modules[(int(m.group(1)), m.group(2))] = name[:name.rindex(".lora_")].removeprefix("base_model.model.")
    alpha, rslora = float(cfg.get("lora_alpha", cfg.get("r", 8))), bool(cfg.get("use_rslora", False))
    out, scales = {}, {}
    for (layer, proj), (a, b) in factors.items():
        if a is None or b is None:
            raise PolicyError(f"{w_path}: layer {layer} {proj} has lora_{'A' if a is None else 'B'} missing")
        if a.shape[0] != b.shape[1]:
            raise PolicyError(f"{w_path}: layer {layer} {proj}: lora_A {tuple(a.shape)} and lora_B "
                              f"{tuple(b.shape)} disagree on the rank")
        r = a.shape[0]
        _check_config_fits(cfg, cfg_path, w_path, (layer, proj, modules[(layer, proj)]), r)
        al = _pattern(cfg.get("alpha_pattern") or {}, layer, proj, alpha, cfg_path, "alpha_pattern")
        scales[(layer, proj)] = al / math.sqrt(r) if rslora else al / r
        out[(layer, proj)] = (a, b)
    return LoraWeights(out, scales), cached_sha256(w_path)  # remembered across runs (files.py)


def _finite(t: np.ndarray, w_path: Path, name: str) -> np.ndarray:
    """NaN or Inf in a factor would make every score of the policy NaN (written as p = 0): refused at load. The
    sum is NaN or Inf whenever an element is (it may also overflow, then each element is looked at): a check
    element by element was most of the policies' load. The sum is numpy's, in this thread: torch's spread each
    factor over its whole thread pool, and beside another process doing the same (a GPU worker reading the bundles
    as its parent does) the sums took many times as long (docs/performance.md)."""
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow only sends it to the element check
        if np.isfinite(t.sum()):
            return t
    bad = ~np.isfinite(t)
    if bad.any():
        first = tuple(int(i) for i in np.argwhere(bad)[0])
        raise PolicyError(f"{w_path}: tensor {name!r} holds {int(bad.sum())} non-finite values (NaN or Inf), "
                          f"first at {first}; the adapter is corrupt or its training diverged: retrain or restore it")
    return t


# adapter_config.json keys under which PEFT computes something other than x + scale * B A x on the named projections
# (DoRA, a bias on B, activated LoRA, QA-LoRA, replicated layers, trained token rows, LoRA on parameters, and
# PEFT's other LoRA variants: block-diagonal, KaSA, MonteCLoRA, Arrow routing)
CHANGES_THE_PRODUCT = ("use_dora", "fan_in_fan_out", "lora_bias", "alora_invocation_tokens", "use_qalora",
                       "layer_replication", "trainable_token_indices", "target_parameters", "use_bdlora",
                       "kasa_config", "monteclora_config", "arrow_config")


def _check_config_fits(cfg: dict, cfg_path: Path, w_path: Path, where: tuple[int, str, str], rank: int) -> None:
    """adapter_config.json must describe the factors as PEFT would load them: their rank is r (or rank_pattern's),
    and their module is among target_modules. PEFT refuses an adapter that disagrees; scoring it would apply the
    config's scale to factors it does not describe."""
    layer, proj, module = where  # module: the path PEFT matched, from the tensor's name
    r = _pattern(cfg.get("rank_pattern") or {}, layer, proj, cfg.get("r", 8), cfg_path, "rank_pattern")
    if r != rank:
        raise PolicyError(f"{cfg_path}: r (or rank_pattern) is {r:g} for layer {layer} {proj}, but its factors in "
                          f"{w_path} have rank {rank}; the config is not the weights': use the adapter's own "
                          "adapter_config.json")
    # a list names modules by their name or a path ending in it; a string is a regular expression PEFT matches
    # against each whole module path; an empty layers_to_transform is PEFT's "every layer"
    targets = cfg.get("target_modules")
    named = (any(t == proj or t.endswith("." + proj) for t in targets) if isinstance(targets, list)
             else _full_match(targets, module, cfg_path) if isinstance(targets, str) else True)
    layers = cfg.get("layers_to_transform") or None
    if not named or (layers is not None and layer not in ([layers] if isinstance(layers, int) else layers)):
        what = f"target_modules {targets!r}" if not named else f"layers_to_transform {layers}"
        raise PolicyError(f"{cfg_path}: {what} does not take {module}, which {w_path} holds factors for, so PEFT "
                          "would not apply them; the config is not the weights': use the adapter's own "
                          "adapter_config.json")


def _full_match(pattern: str, module: str, cfg_path: Path) -> bool:
    try:
        return re.fullmatch(pattern, module) is not None
    except re.error as e:
        raise PolicyError(f"{cfg_path}: target_modules {pattern!r} is not a regular expression ({e})") from e


def _module(layer: int, proj: str) -> str:
    return f"model.layers.{layer}.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}"


def _pattern(patterns: dict, layer: int, proj: str, default: float, cfg_path: Path, what: str) -> float:
    """PEFT's alpha_pattern and rank_pattern: a key is a regular expression for the module name's end."""
    module = _module(layer, proj)
    for key, value in patterns.items():
        try:
            hit = re.match(rf"(.*\.)?({key})$", module)  # PEFT's own rule
        except re.error as e:
            raise PolicyError(f"{cfg_path}: {what} key {key!r} is neither a module name's end nor a regular "
                              f"expression ({e})") from e
        if hit:
            return float(value)
    return default


def check_policy(policy: Policy, cfg: ModelConfig) -> None:
    """The adapter's tensors must fit the base model's projections."""
    for (layer, proj), (a, b) in policy.lora.factors.items():
        where = f"policy {policy.name!r} ({policy.path}): layer {layer} {proj}"
        if layer >= cfg.layers:
            raise PolicyError(f"{where}: the model has only {cfg.layers} layers; is this adapter for another model?")
        out_f, in_f = cfg.proj_shape(proj)
        if a.shape[1] != in_f or b.shape[0] != out_f:
            raise PolicyError(f"{where}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do not fit the "
                              f"model's {proj} ({out_f} x {in_f}); is this adapter for another model?")


def fingerprint(policy: Policy) -> str:
    """The policy but its LoRA factors (arrays do not compare with ==), the adapter's sha256 and scales kept, as a
    string: a NaN read from policy.json equals itself there, not as a float."""
    return repr(replace(policy, lora=LoraWeights({}, policy.lora.scales)))


def load_policies(paths: list[str | Path]) -> list[Policy]:
    """Each path is a bundle (has policy.json) or a folder of bundles (taken in name order)."""
    bundles: list[Path] = []
    for path in map(Path, paths):
        if (path / "policy.json").is_file():
            bundles.append(path)
        elif path.is_dir():
            found = sorted(d for d in path.iterdir() if (d / "policy.json").is_file())
            if not found:
                raise PolicyError(f"{path}: neither a policy bundle nor a folder of bundles (no policy.json)")
            bundles += found
        else:
            raise PolicyError(f"{path}: no such policy bundle or folder")
    out = [load_policy(b) for b in bundles]
    names = [p.name for p in out]
    dup = {n for n in names if names.count(n) > 1}
    if dup:
        raise PolicyError(f"policy names must be unique; {sorted(dup)} appear more than once")
    return out
