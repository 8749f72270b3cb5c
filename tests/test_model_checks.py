"""A model or policy whose files are wrong is refused with one line before anything is scored: config.json against
the checkpoint's tensors (shapes, layer count, tensors it leaves out, dtypes), the tokenizer's ids against the
embedding's rows, and wrong JSON types or absurd values in config.json and policy.json, each named by file and
field (engine/json_schema.py)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
from cli_cases import SAMPLE
from safetensors.torch import load_file, save_file

from policyscan.engine.errors import CheckpointError, PolicyError
from policyscan.engine.json_schema import Field, check
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.policy.bundle import load_policies, load_policy
from policyscan.engine.run.runner import Engine, check_token_ids
from policyscan.engine.settings import EngineSettings
from policyscan.engine.text.prompts import TextEncoder

GONE = object()  # a config change that deletes the key
NAN = float("nan")
DEEP = "[" * 100_000 + "]" * 100_000  # json.loads raises RecursionError on it


def model_copy(tmp_path, **changes):
    """The sample model in tmp_path/model, its config.json changed (GONE deletes a key)."""
    d = shutil.copytree(SAMPLE / "model", tmp_path / "model")
    cfg = json.loads((d / "config.json").read_text())
    for key, value in changes.items():
        if value is GONE:
            del cfg[key]
        else:
            cfg[key] = value
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def edit_tensors(model_dir, change) -> None:
    tensors = load_file(model_dir / "model.safetensors")
    change(tensors)
    save_file(tensors, model_dir / "model.safetensors")


def refused(model_dir, match: str) -> str:
    with pytest.raises(CheckpointError, match=match) as e:
        Checkpoint.open(model_dir)
    return str(e.value)


# --- config.json against the tensors ---

@pytest.mark.parametrize("changes, match", [
    ({"num_hidden_layers": 2}, r"num_hidden_layers is 2, but model.safetensors holds tensors of 4 layers, up to "
                               r"model.layers.3"),
    ({"num_hidden_layers": 6}, r"num_hidden_layers is 6, but the safetensors files hold no tensor of model.layers.4"),
    ({"vocab_size": 2048}, r"vocab_size is 2048, but model.embed_tokens.weight in model.safetensors has 1024 rows"),
    ({"vocab_size": 1000}, r"vocab_size is 1000, but model.embed_tokens.weight .* 1024 rows"),
    ({"hidden_size": 256}, r"hidden_size is 256, but model.embed_tokens.weight .* 128 columns"),
    ({"intermediate_size": 300}, r"intermediate_size is 300, but model.layers.0.mlp.gate_proj.weight .* 352 rows"),
    ({"num_attention_heads": 8}, r"num_attention_heads x head_dim is 8 x 32 = 256, but "
                                 r"model.layers.0.self_attn.q_proj.weight .* 128 rows"),
    ({"num_key_value_heads": 4}, r"num_key_value_heads x head_dim is 4 x 32 = 128, but "
                                 r"model.layers.0.self_attn.k_proj.weight .* 64 rows"),
    ({"head_dim": 16}, r"num_attention_heads x head_dim is 4 x 16 = 64, but .*q_proj.weight .* 128 rows"),
    ({"head_dim": GONE, "num_attention_heads": 8}, r"num_key_value_heads x head_dim is 2 x 16 = 32, but "
                                                   r"model.layers.0.self_attn.k_proj.weight .* 64 rows"),
    ({"tie_word_embeddings": False}, r"tensors missing .* first 'lm_head.weight'; .*tie_word_embeddings is false"),
    ({"attention_bias": True}, r"tensors missing .* first 'model.layers.0.self_attn.q_proj.bias'; .*attention_bias is"),
    ({"architectures": ["Qwen3ForCausalLM"]}, r"tensors missing .* first 'model.layers.0.self_attn.q_norm.weight'; "
                                              r"config.json's architectures make this a qwen3 model"),
    ({"architectures": ["Gemma2ForCausalLM"], "hidden_act": GONE},
     r"tensors missing .*pre_feedforward_layernorm.*a gemma2 model"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {}}},
     r"tensors missing .*weight_scale'; config.json's quantization_config"),
])
def test_a_config_that_disagrees_with_the_tensors_names_the_field_and_the_tensor(tmp_path, changes, match):
    d = model_copy(tmp_path, **changes)
    message = refused(d, match)
    assert str(d) in message


@pytest.mark.parametrize("change, match", [
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.bias": torch.zeros(128)}),
     r"model.safetensors: tensor 'model.layers.0.self_attn.q_proj.bias' is not part of the model .*attention_bias"),
    (lambda t: t.update({"lm_head.weight": t["model.embed_tokens.weight"].clone()}), None),  # tied: left unread
    (lambda t: t.update({"lm_head.weight": torch.zeros(2048, 128)}), r"vocab_size is 1024, but lm_head.weight .* "
                                                                      r"2048 rows"),
    (lambda t: t.update({"model.layers.0.self_attn.q_proj.input_scale": torch.ones(1)}),
     r"input_scale' .*static activation scales"),
    (lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(3)}), r"not part of the model .*llama"),
    (lambda t: t.update({"model.layers.0.self_attn.rotary_emb.inv_freq": torch.zeros(16)}), None),  # a stored table
    (lambda t: t.update({"model.layers.7.self_attn.rotary_emb.inv_freq": torch.zeros(16)}),
     r"num_hidden_layers is 4, but model.safetensors holds tensors of 5 layers, up to model.layers.7"),
    (lambda t: t.update({"model.norm.weight": t["model.norm.weight"].reshape(128, 1)}),
     r"'model.norm.weight' has shape \[128, 1\], where config.json"),
    (lambda t: t.update({"model.norm.weight": torch.ones(128, dtype=torch.int32)}),
     r"'model.norm.weight' is I32; .*floating point"),
    (lambda t: t.update({"model.layers.1.mlp.up_proj.weight": t["model.layers.1.mlp.up_proj.weight"].to(
        torch.float8_e4m3fn)}), r"up_proj.weight' is F8_E4M3; config.json has no quantization_config"),
])
def test_tensors_the_config_does_not_describe_are_refused(tmp_path, change, match):
    d = model_copy(tmp_path)
    edit_tensors(d, change)
    if match is None:
        assert Checkpoint.open(d).config.layers == 4
    else:
        refused(d, match)


def test_a_sharded_checkpoint_whose_index_and_shards_disagree_is_refused(tmp_path):
    d = model_copy(tmp_path)
    tensors = load_file(d / "model.safetensors")
    names = sorted(tensors)
    (d / "model.safetensors").unlink()
    save_file({n: tensors[n] for n in names[:20]}, d / "model-00001-of-00002.safetensors")
    save_file({n: tensors[n] for n in names[20:]}, d / "model-00002-of-00002.safetensors")
    weight_map = {n: f"model-0000{1 + (i >= 20)}-of-00002.safetensors" for i, n in enumerate(names)}
    index = d / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": weight_map}))
    assert Checkpoint.open(d).config.layers == 4
    index.write_text(json.dumps({"weight_map": {**weight_map, names[0]: "model-00002-of-00002.safetensors"}}))
    refused(d, rf"index.json: names 1 tensors in model-00002-of-00002.safetensors that it does not hold, first "
               rf"'{names[0]}'")
    index.write_text(json.dumps({"weight_map": list(weight_map)}))
    refused(d, r"index.json: weight_map must be an object, got a list")


# --- config.json: types and absurd values, by field ---

@pytest.mark.parametrize("changes, match", [
    ({"hidden_size": "128"}, r'hidden_size must be an integer from 1 to 65536, got the string "128"'),
    ({"hidden_size": None}, r"hidden_size must be an integer from 1 to 65536, got null"),
    ({"hidden_size": 128.0}, r"hidden_size must be an integer .*, got 128.0"),
    ({"hidden_size": True}, r"hidden_size must be an integer .*, got true"),
    ({"hidden_size": GONE}, r"missing hidden_size \(an integer from 1 to 65536\)"),
    ({"hidden_size": 10**9}, r"hidden_size must be an integer from 1 to 65536, got 1000000000"),
    ({"num_hidden_layers": [4]}, r"num_hidden_layers must be an integer from 1 to 1024, got a list \[4\]"),
    ({"num_hidden_layers": 10**6}, r"num_hidden_layers must be an integer from 1 to 1024, got 1000000"),
    ({"vocab_size": {"n": 1024}}, r"vocab_size must be an integer .*, got an object"),
    ({"num_key_value_heads": "2"}, r"num_key_value_heads must be an integer from 1 to 1024 or null"),
    ({"head_dim": 0}, r"head_dim must be an integer from 1 to 1024 or null, got 0"),
    ({"head_dim": 33}, r"head_dim 33 must be even"),
    ({"max_position_embeddings": 10**15}, r"max_position_embeddings must be an integer from 1 to 2147483647"),
    ({"rms_norm_eps": "1e-5"}, r"rms_norm_eps must be a finite number in \(0, 1\)"),
    ({"rms_norm_eps": NAN}, r"rms_norm_eps must be a finite number in \(0, 1\), got nan"),
    ({"tie_word_embeddings": "false"}, r'tie_word_embeddings must be true or false or null, got the string "false"'),
    ({"tie_word_embeddings": 1}, r"tie_word_embeddings must be true or false or null, got 1"),
    ({"architectures": "LlamaForCausalLM"}, r"architectures must be a list or null, got the string"),
    ({"architectures": [{"name": "LlamaForCausalLM"}]}, r"architectures\[0\] must be a string, got an object"),
    ({"hidden_act": ["silu"]}, r"hidden_act must be a string, got a list"),
    ({"rope_theta": -1}, r"rope_theta must be a finite number above 0 or null, got -1"),
    ({"rope_parameters": "default"}, r"rope_parameters must be an object or null"),
    ({"rope_parameters": {"rope_type": "linear", "factor": NAN}}, r"rope_parameters.factor must be a finite number "
                                                                  r"above 0, got nan"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 10**15}},
     r"rope_parameters.original_max_position_embeddings must be an integer from 1 to 2147483647"),
    ({"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0}},
     r"rope high_freq_factor 4.0 must be greater than low_freq_factor 4.0"),
    ({"rope_scaling": {"type": "yarn", "factor": 4.0}}, r"rope_scaling type 'yarn' is not supported"),
    ({"sliding_window": "4096"}, r"sliding_window must be an integer from 0 to 2147483647 or null"),
    ({"quantization_config": "fp8"}, r"quantization_config must be an object or null"),
    ({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {"group_0": 3}}},
     r"quantization_config.config_groups.group_0 must be an object, got 3"),
    ({"quantization_config": {"quant_method": "compressed-tensors",
                              "config_groups": {"g": {"weights": {"num_bits": "8"}}}}},
     r"quantization_config.config_groups.g.weights.num_bits must be an integer or null"),
])
def test_a_config_field_of_the_wrong_type_or_range_is_refused_by_name(tmp_path, changes, match):
    d = model_copy(tmp_path, **changes)
    message = refused(d, match)
    assert f"{d / 'config.json'}: " in message


@pytest.mark.parametrize("content, match", [
    ("[1, 2]", r"config.json: must hold a JSON object, got a list"),
    (DEEP, r"config.json: its JSON is nested too deeply to read"),
    (b"{\"hidden_size\": \"\xff\"}", r"config.json: not valid JSON"),
])
def test_a_config_json_that_is_no_object_is_refused(tmp_path, content, match):
    d = model_copy(tmp_path)
    path = d / "config.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    refused(d, match)


def test_the_schema_says_ranges_and_choices_as_a_person_would():
    assert Field("int", low=1, high=8).expected() == "an integer from 1 to 8"
    assert Field("number|null", above=0).expected() == "a finite number above 0 or null"
    assert Field("number", low=0, below=1).expected() == "a finite number in [0, 1)"
    assert Field("str|null", choices=("a", "b")).expected() == '"a" or "b" or null'
    with pytest.raises(ValueError, match="unknown JSON types"):
        Field("integer")
    with pytest.raises(PolicyError, match=r"x: n.k must be true or false, got 10000000000000000000000"):
        check({"n": {"k": 10**22}}, {"n": Field("object", fields={"k": Field("bool")})}, "x", PolicyError)
    with pytest.raises(PolicyError, match=r"x: n must be a finite number, got 1000"):  # past a float's range
        check({"n": 10**1000}, {"n": Field("number")}, "x", PolicyError)


# --- policy.json: types, by field (adapter_config.json: tests/test_load_errors.py) ---

def policy_copy(tmp_path, file: str, change) -> object:
    """The sample pii bundle in tmp_path/pii, its `file` changed by `change` (a function of the parsed JSON that
    edits it or returns what to write instead)."""
    d = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    data = json.loads((d / file).read_text())
    new = change(data)
    (d / file).write_text(new if isinstance(new, str) else json.dumps(data if new is None else new))
    return d


def put(path: str, value):
    """A change that sets one dotted field."""
    def change(data):
        *parents, last = path.split(".")
        for p in parents:
            data = data.setdefault(p, {})
        data[last] = value
    return change


@pytest.mark.parametrize("change, match", [
    (put("name", 5), r"name must be a non-empty string, got 5"),
    (put("name", ""), r'name must be a non-empty string, got the string ""'),
    (put("labels", "Compliant"), r"labels must be an object, got the string"),
    (put("labels.compliant", None), r"labels.compliant must be a non-empty string, got null"),
    (lambda d: d["labels"].pop("violation") and None, r"missing labels.violation \(a non-empty string\)"),
    (put("template", []), r"template must be an object or null, got a list"),
    (put("template.prefix", {"text": "x"}), r"template.prefix must be a string, got an object"),
    (put("template.suffix", 3), r"template.suffix must be a string, got 3"),
    (put("calibration.a", "1.1"), r'calibration.a must be a finite number, got the string "1.1"'),
    (put("calibration.b", NAN), r"calibration.b must be a finite number, got nan"),
    (put("calibration.fp8_check", {"flip_share": 2}), r"calibration.fp8_check.flip_share must be a finite number "
                                                      r"from 0 to 1, got 2"),
    (put("threshold", True), r"threshold must be a finite number in \(0, 1\), got true"),
    (put("threshold", 1.5), r"threshold must be a finite number in \(0, 1\), got 1.5"),
    (put("chat_template", {"file": "x.jinja"}), r"chat_template must be a non-empty string or null, got an object"),
    (put("adapter", 1), r'adapter must be "required" or "optional", got 1'),
    (put("description", ["a"]), r"description must be a string, got a list"),
    (lambda d: "[]", r"policy.json: must hold a JSON object, got a list"),
    (lambda d: DEEP, r"policy.json: its JSON is nested too deeply"),
])
def test_a_policy_json_field_of_the_wrong_type_is_refused_by_name(tmp_path, change, match):
    d = policy_copy(tmp_path, "policy.json", change)
    with pytest.raises(PolicyError, match=match) as e:
        load_policy(d)
    assert str(d / "policy.json") in str(e.value)


# --- the tokenizer's ids against the embedding ---

def _id_past_the_table(tok):
    vocab = tok["model"]["vocab"]
    vocab[next(k for k, i in vocab.items() if i == 1000)] = 5000


@pytest.mark.parametrize("change, match", [
    (_id_past_the_table, r"tokenizer.json: the tokenizer has 1024 tokens with its added tokens, ids up to 5000, but "
                         r"the model's embedding has 1024 rows \(vocab_size in config.json\)"),
    (lambda tok: tok["added_tokens"].append({**tok["added_tokens"][0], "id": 1024, "content": "<|x|>"}),
     r"tokenizer.json: the tokenizer has 1025 tokens .* ids up to 1024, but the model's embedding has 1024 rows"),
    (lambda tok: tok["post_processor"]["special_tokens"]["<|bos|>"].update(ids=[4000]),
     r"tokenizer.json: the tokenizer adds BOS token id 4000, but the model's embedding has 1024 rows"),
])
def test_a_tokenizer_whose_ids_pass_the_embedding_is_refused_before_the_weights_load(tmp_path, change, match):
    d = model_copy(tmp_path)
    tok = json.loads((d / "tokenizer.json").read_text())
    change(tok)
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(CheckpointError, match=match):
        Engine(d, load_policies([SAMPLE / "policies"]), EngineSettings("cpu"))


def test_label_ids_past_the_embedding_are_refused_naming_the_policy():
    policies = load_policies([SAMPLE / "policies"])
    encoder, ckpt = TextEncoder(SAMPLE / "model", fast=False), Checkpoint.open(SAMPLE / "model")
    check_token_ids(encoder, ckpt, policies, [(3, 7), (5, 9)])
    with pytest.raises(CheckpointError, match=r"gives policy 'pii' .* label token ids \(5, 1024\), but the model's "
                                              r"embedding has 1024 rows"):
        check_token_ids(encoder, ckpt, policies, [(3, 7), (5, 1024)])


# --- the command line: one line, exit 1, naming the file and the field ---

def _cli(tmp_path, *args) -> tuple[int, str]:
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps({"text": "user: hello"}) + "\n")
    res = subprocess.run([sys.executable, "-m", "policyscan.cli.main", "score", str(src), "-o",
                          str(tmp_path / "o.jsonl"), "--no-progress", *map(str, args)], capture_output=True, text=True,
                         timeout=300)
    assert not (tmp_path / "o.jsonl").exists()
    return res.returncode, res.stdout + res.stderr


@pytest.mark.parametrize("case", ["layers", "type", "policy", "adapter_header", "tokenizer", "tokenizer_config"])
def test_the_command_line_refuses_wrong_files_in_one_line(tmp_path, case):
    policies = SAMPLE / "policies"
    if case == "layers":
        model, named = model_copy(tmp_path, num_hidden_layers=2), ("config.json", "num_hidden_layers is 2")
    elif case == "type":
        model, named = model_copy(tmp_path, hidden_size="128"), ("config.json", "hidden_size must be an integer")
    elif case == "policy":
        model, policies = SAMPLE / "model", policy_copy(tmp_path, "policy.json", put("template.prefix", {}))
        named = ("pii/policy.json", "template.prefix must be a string, got an object")
    elif case == "tokenizer":
        model = model_copy(tmp_path)
        (model / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": "not a vocabulary"}}')
        named = ("tokenizer.json", "not a tokenizer file")
    elif case == "tokenizer_config":
        model = model_copy(tmp_path)
        cfg = json.loads((model / "tokenizer_config.json").read_text())
        (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": 7}))
        named = ("tokenizer_config.json", "chat_template must be a string or a list or null, got 7")
    else:
        model, policies = SAMPLE / "model", shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
        text = b'{"x": ' + DEEP.encode() + b"}"
        (policies / "adapter_model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text)
        named = ("adapter_model.safetensors", "nested too deeply")
    code, out = _cli(tmp_path, "--model", model, "--policies", policies)
    lines = out.strip().splitlines()
    assert code == 1 and len(lines) == 1 and "Traceback" not in out, out
    assert all(n in lines[0] for n in named), out
