"""What policyscan reads from its JSON files (config.json, tokenizer_config.json, policy.json, adapter_config.json,
chat_template.json), declared field by
field: the JSON types a field may take, its range, whether it is required. Each file is checked once, when it
loads, so that a wrong value is one line naming the file and the field, never a traceback where it is used."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from policyscan.engine import strict_json
from policyscan.engine.errors import PolicyscanError

# JSON type name -> how a message says it
KINDS = {"int": "an integer", "number": "a number", "bool": "true or false", "str": "a string", "list": "a list",
         "object": "an object", "null": "null"}
SHOWN = 60  # characters of a wrong value a message quotes


@dataclass(frozen=True)
class Field:
    """One field. types: JSON type names of KINDS joined by '|' ("int|null"). Numbers may have bounds, low and
    high inclusive, above and below exclusive (numbers are always finite); strings a tuple of allowed values or
    nonempty; lists one Field for their items; objects Fields for their members by name (`fields`, other
    members allowed) or one Field for every member (`each`)."""

    types: str
    required: bool = False
    low: float | None = None
    high: float | None = None
    above: float | None = None
    below: float | None = None
    choices: tuple[str, ...] | None = None
    nonempty: bool = False
    items: Field | None = None
    fields: dict[str, Field] | None = None
    each: Field | None = None

    def __post_init__(self) -> None:
        unknown = set(self.kinds) - set(KINDS)
        if unknown:
            raise ValueError(f"unknown JSON types {sorted(unknown)} in a schema field (known: {', '.join(KINDS)})")

    @property
    def kinds(self) -> list[str]:
        return self.types.split("|")

    def expected(self) -> str:
        """What the field must be, as a message says it: 'an integer from 1 to 65536 or null'."""
        if self.choices is not None:
            said = [" or ".join(json.dumps(c) for c in self.choices)]
            return " or ".join(said + [KINDS[k] for k in self.kinds if k != "str"])
        return " or ".join(self._say(k) for k in self.kinds)

    def _say(self, kind: str) -> str:
        if kind == "str" and self.nonempty:
            return "a non-empty string"
        if kind not in ("int", "number"):
            return KINDS[kind]
        said = "a finite number" if kind == "number" else KINDS[kind]
        lo = f"[{_num(self.low)}" if self.low is not None else f"({_num(self.above)}" if self.above is not None else ""
        hi = f"{_num(self.high)}]" if self.high is not None else f"{_num(self.below)})" if self.below is not None \
            else ""
        if lo and hi:
            return (f"{said} from {lo[1:]} to {hi[:-1]}" if lo[0] == "[" and hi[-1] == "]"
                    else f"{said} in {lo}, {hi}")
        if lo:
            return f"{said} of at least {lo[1:]}" if lo[0] == "[" else f"{said} above {lo[1:]}"
        if hi:
            return f"{said} of at most {hi[:-1]}" if hi[-1] == "]" else f"{said} below {hi[:-1]}"
        return said


def load(path: Path, schema: dict[str, Field], error: type[PolicyscanError]) -> dict:
    """The file's JSON object, checked against `schema` (a Field per member); anything wrong: `error` naming the
    file and the field."""
    data = read_json(path, error)
    check(data, schema, str(path), error)
    return data


def read_json(path: Path, error: type[PolicyscanError]) -> object:
    """The file's JSON, unchecked; not JSON, an object naming a key twice, or nested past what Python parses: `error`
    naming the file."""
    try:
        return strict_json.loads(Path(path).read_bytes())
    except RecursionError as e:  # json.loads gives up past Python's recursion limit (a thousand levels or so)
        raise error(f"{path}: its JSON is nested too deeply to read; the file is damaged or not what it is "
                    "named") from e
    except ValueError as e:  # JSONDecodeError, DuplicateKeyError, UnicodeDecodeError (bytes in no Unicode encoding)
        raise error(f"{path}: not valid JSON ({e})") from e


def check(data: object, schema: dict[str, Field], source: str, error: type[PolicyscanError]) -> None:
    """`data` must be an object whose members fit `schema`; `source` names it in the message."""
    if not isinstance(data, dict):
        raise error(f"{source}: must hold a JSON object, got {_show(data)}")
    _members(data, schema, "", source, error)


def _members(data: dict, schema: dict[str, Field], path: str, source: str, error: type[PolicyscanError]) -> None:
    for name, field in schema.items():
        where = f"{path}{name}"
        if name not in data:
            if field.required:
                raise error(f"{source}: missing {where} ({field.expected()})")
            continue
        _value(data[name], field, where, source, error)


def _value(value: object, field: Field, where: str, source: str, error: type[PolicyscanError]) -> None:
    kind = _kind(value)
    if kind not in field.kinds and not (kind == "int" and "number" in field.kinds):
        raise error(f"{source}: {where} must be {field.expected()}, got {_show(value)}")
    if kind in ("int", "number"):
        if not _in_range(value, field):
            raise error(f"{source}: {where} must be {field.expected()}, got {_show(value)}")
    elif kind == "str":
        if (field.choices is not None and value not in field.choices) or (field.nonempty and not value):
            raise error(f"{source}: {where} must be {field.expected()}, got {_show(value)}")
    elif kind == "list" and field.items is not None:
        for i, item in enumerate(value):
            _value(item, field.items, f"{where}[{i}]", source, error)
    elif kind == "object":
        if field.fields is not None:
            _members(value, field.fields, f"{where}.", source, error)
        if field.each is not None:
            for key, member in value.items():
                _value(member, field.each, f"{where}.{key}", source, error)


def _kind(value: object) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):  # before int: True is an int to Python, not to JSON
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "number"
    return {str: "str", list: "list", dict: "object"}[type(value)]


def _in_range(value: int | float, field: Field) -> bool:
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an integer past a float's range
        finite = False
    return finite and (field.low is None or value >= field.low) and (field.high is None or value <= field.high) \
        and (field.above is None or value > field.above) and (field.below is None or value < field.below)


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else repr(x)


def _show(value: object) -> str:
    """A wrong value as a message quotes it: its JSON, cut short, and what it is when that is not plain."""
    if isinstance(value, (list, dict)):
        what = "a list" if isinstance(value, list) else "an object"
        try:
            text = json.dumps(value)
        except (RecursionError, ValueError):
            return what
        return f"{what} {text[:SHOWN]}{'...' if len(text) > SHOWN else ''}"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    text = json.dumps(value)
    text = text[:SHOWN] + ("..." if len(text) > SHOWN else "")
    return f"the string {text}" if isinstance(value, str) else text


# --- the files' schemas: what policyscan reads of each (other members are allowed and left alone) ---

def _count(high: int, types: str = "int", required: bool = False) -> Field:
    return Field(types, required=required, low=1, high=high)


_POSITIVE = Field("number", above=0)
_FLAG = Field("bool|null")  # null: the field's default
_POSITIONS = 2**31 - 1
_ROPE_FIELDS = {
    "rope_type": Field("str|null"), "type": Field("str|null"), "rope_theta": Field("number|null", above=0),
    "factor": _POSITIVE, "low_freq_factor": _POSITIVE, "high_freq_factor": _POSITIVE,
    "original_max_position_embeddings": _count(_POSITIONS)}
# gemma3's rope_parameters hold one rope per layer type
_ROPE = Field("object|null", fields={**_ROPE_FIELDS, **{kind: Field("object|null", fields=_ROPE_FIELDS)
                                                         for kind in ("full_attention", "sliding_attention")}})
# a model's config.json (ModelConfig.from_dict, Checkpoint.open); the bounds lie far beyond any real model's
CONFIG: dict[str, Field] = {
    "architectures": Field("list|null", items=Field("str")),
    "hidden_size": _count(1 << 16, required=True),
    "intermediate_size": _count(1 << 20, required=True),
    "num_hidden_layers": _count(1024, required=True),
    "num_attention_heads": _count(1024, required=True),
    "num_key_value_heads": _count(1024, "int|null"),
    "head_dim": _count(1024, "int|null"),
    "vocab_size": _count(1 << 24, required=True),
    "max_position_embeddings": _count(_POSITIONS),
    "rms_norm_eps": Field("number", above=0, below=1),
    "tie_word_embeddings": _FLAG, "attention_bias": _FLAG, "mlp_bias": _FLAG, "use_sliding_window": _FLAG,
    "use_bidirectional_attention": _FLAG,
    "sliding_window": Field("int|null", low=0, high=_POSITIONS),
    "hidden_act": Field("str"), "hidden_activation": Field("str"),
    "rope_theta": Field("number|null", above=0), "rope_scaling": _ROPE, "rope_parameters": _ROPE,
    "rope_local_base_freq": Field("number|null", above=0),
    "layer_types": Field("list|null", items=Field("str")), "sliding_window_pattern": _count(1024, "int|null"),
    "query_pre_attn_scalar": _POSITIVE,
    "attn_logit_softcapping": Field("number|null", above=0), "final_logit_softcapping": Field("number|null", above=0),
    "attention_multiplier": _POSITIVE, "embedding_multiplier": _POSITIVE, "residual_multiplier": _POSITIVE,
    "logits_scaling": _POSITIVE,
    "quantization_config": Field("object|null", fields={
        "quant_method": Field("str|null"),
        "config_groups": Field("object|null", each=Field("object", fields={"weights": Field("object|null", fields={
            "num_bits": Field("int|null"), "type": Field("str|null"), "strategy": Field("str|null")})}))}),
}
# model.safetensors.index.json of a sharded checkpoint
INDEX: dict[str, Field] = {"weight_map": Field("object", required=True, each=Field("str", nonempty=True))}
# a policy bundle's policy.json (load_policy)
POLICY: dict[str, Field] = {
    "name": Field("str", required=True, nonempty=True),
    "description": Field("str"),
    "labels": Field("object", required=True, fields={"compliant": Field("str", required=True, nonempty=True),
                                                     "violation": Field("str", required=True, nonempty=True)}),
    "template": Field("object|null", fields={"prefix": Field("str"), "suffix": Field("str")}),
    "chat_template": Field("str|null", nonempty=True),
    "calibration": Field("object|null", fields={
        "a": Field("number"), "b": Field("number"),
        "fp8_check": Field("object|null", fields={"flip_share": Field("number", low=0, high=1)})}),
    "threshold": Field("number", above=0, below=1),
    "adapter": Field("str", choices=("required", "optional")),
}
# a PEFT adapter's adapter_config.json (load_adapter)
ADAPTER_CONFIG: dict[str, Field] = {
    "peft_type": Field("str"), "bias": Field("str"),
    "use_dora": _FLAG, "fan_in_fan_out": _FLAG, "use_rslora": _FLAG,
    "modules_to_save": Field("list|null", items=Field("str")),
    "r": _count(1 << 16), "lora_alpha": Field("number"),
    "alpha_pattern": Field("object|null", each=Field("number")),
    "rank_pattern": Field("object|null", each=_count(1 << 16)),
    "target_modules": Field("list|str|null", items=Field("str")),
    "layers_to_transform": Field("int|list|null", items=Field("int")),
    "lora_bias": _FLAG, "use_qalora": _FLAG, "alora_invocation_tokens": Field("list|null"),
    "layer_replication": Field("list|null"), "trainable_token_indices": Field("list|object|null"),
    "target_parameters": Field("list|null"),
}
# a model's tokenizer_config.json and chat_template.json (chat_template.read_tokenizer_config, model_templates)
_TOKEN = Field("str|object|null", fields={"content": Field("str")})
TOKENIZER_CONFIG: dict[str, Field] = {
    "chat_template": Field("str|list|null", items=Field("object", fields={"name": Field("str", required=True),
                                                                       "template": Field("str", required=True)})),
    "bos_token": _TOKEN, "eos_token": _TOKEN,
}
CHAT_TEMPLATE_JSON: dict[str, Field] = {"chat_template": Field("str|null")}
# an output's metadata, as far as `policyscan verify` reads it to repeat the run (outputs/run_output.py writes it)
_S, _S_NULL = Field("str", required=True), Field("str|null")
OUTPUT_METADATA: dict[str, Field] = {
    "model": Field("object", required=True, fields={"path": _S, "sha256": _S}),
    "model_files": Field("object|null", each=Field("str")),
    "device": _S, "precision": _S, "numerics": Field("object|null"), "max_length": Field("int|null"),
    "chat_template": Field("object|null"),
    "inputs": Field("list", required=True, items=Field("object", fields={
        "path": _S, "sha256": Field("str|null", required=True), "abs_path": _S_NULL, "rel_path": _S_NULL})),
    "policies": Field("list", required=True, items=Field("object", fields={
        "name": _S, "path": _S, "adapter_sha256": Field("str|null", required=True), "prefix": _S, "suffix": _S,
        "labels": Field("list", required=True, items=Field("str")),
        "calibration": Field("object", required=True, fields={"a": Field("number", required=True),
                                                              "b": Field("number", required=True)})})),
    "settings": Field("object", required=True, fields={
        "batch_tokens": Field("int", required=True), "max_length": Field("int", required=True), "precision": _S,
        "cuda_graphs": _FLAG, "chat_template": _S_NULL, "text_is_rendered": _FLAG,
        "fp8_flip_limit": Field("number|null")}),
    "read": Field("object", required=True, fields={"keep": Field("list", items=Field("str")),
                                                   "id_column": _S_NULL}),
    "output": Field("object", required=True, fields={"layout": Field("str", required=True,
                                                                     choices=("wide", "long"))}),
}
