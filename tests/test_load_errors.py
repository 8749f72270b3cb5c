"""Bad checkpoints and bad adapters: each gets an error that names the file and says what to do."""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from cli_cases import SAMPLE
from hf_fixtures import SPECS, make_model, make_policy
from safetensors.torch import load_file, save_file

from policyscan.engine.errors import CheckpointError, PolicyError
from policyscan.engine.files import in_background
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.kernels import reference


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("errs")
    model = make_model(root / "model", "llama")
    make_policy(model, root / "good", "good", SPECS[1], seed=1)
    other = make_model(root / "other", "llama", hidden_size=64, num_attention_heads=4)
    make_policy(other, root / "foreign", "foreign", SPECS[1], seed=2)
    return root


def copy(built, name, tmp_path):
    return shutil.copytree(built / name, tmp_path / name)


def test_missing_dir_and_config(tmp_path):
    with pytest.raises(CheckpointError, match="model directory not found"):
        Checkpoint.open(tmp_path / "nope")
    (tmp_path / "m").mkdir()
    with pytest.raises(CheckpointError, match="no config.json"):
        Checkpoint.open(tmp_path / "m")


def test_unknown_architecture(built, tmp_path):
    d = copy(built, "model", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"GPT2LMHeadModel.*not supported.*LlamaForCausalLM"):
        Checkpoint.open(d)


def test_pickle_only_checkpoint_is_refused(built, tmp_path):
    d = copy(built, "model", tmp_path)
    (d / "model.safetensors").unlink()
    torch.save({"x": torch.zeros(1)}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin, a pickle file.*never loads"):
        Checkpoint.open(d)


def test_missing_shard(built, tmp_path):
    d = copy(built, "model", tmp_path)
    index = {"weight_map": {"a": "model-00002-of-00002.safetensors"}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors, which is not in"):
        Checkpoint.open(d)


def test_missing_tensor(built, tmp_path):
    d = copy(built, "model", tmp_path)
    t = load_file(d / "model.safetensors")
    del t["model.layers.1.mlp.down_proj.weight"]
    save_file(t, d / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"missing.*model.layers.1.mlp.down_proj.weight"):
        Checkpoint.open(d)


def test_corrupt_safetensors(built, tmp_path):
    d = copy(built, "model", tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00\x01garbage")
    with pytest.raises(CheckpointError, match="model.safetensors: not a safetensors file"):
        Checkpoint.open(d)


def attach(built, policy_dir):
    dec = load_decoder(Checkpoint.open(built / "model"), reference, Precision(torch.float32))
    attach_policies(dec, [load_policy(policy_dir)], [(1, 2)])


def test_adapter_for_another_model(built):
    with pytest.raises(PolicyError, match=r"policy 'foreign'.*layer 0 .*do not fit.*another model"):
        attach(built, built / "foreign")


def test_adapter_extra_tensor(built, tmp_path):
    d = copy(built, "good", tmp_path)
    t = load_file(d / "adapter_model.safetensors")
    t["base_model.model.lm_head.lora_A.weight"] = torch.zeros(8, 96)
    save_file(t, d / "adapter_model.safetensors")
    with pytest.raises(PolicyError, match=r"lm_head.lora_A.weight.*not a LoRA factor"):
        load_policy(d)


def test_adapter_missing_b(built, tmp_path):
    d = copy(built, "good", tmp_path)
    t = load_file(d / "adapter_model.safetensors")
    del t["base_model.model.model.layers.2.self_attn.q_proj.lora_B.weight"]
    save_file(t, d / "adapter_model.safetensors")
    with pytest.raises(PolicyError, match="layer 2 q_proj has lora_B missing"):
        load_policy(d)


def test_adapter_layer_out_of_range(built, tmp_path):
    d = copy(built, "good", tmp_path)
    t = load_file(d / "adapter_model.safetensors")
    t = {k.replace("layers.2.", "layers.7."): v for k, v in t.items()}
    save_file(t, d / "adapter_model.safetensors")
    with pytest.raises(PolicyError, match="only 3 layers"):
        attach(built, d)


@pytest.mark.parametrize("key,value,msg", [("use_dora", True, "use_dora=True is not supported"),
                                           ("bias", "all", "only bias='none'"),
                                           ("modules_to_save", ["lm_head"], "modules_to_save"),
                                           ("peft_type", "IA3", "only LoRA")])
def test_adapter_config_variants_refused(built, tmp_path, key, value, msg):
    d = copy(built, "good", tmp_path)
    cfg = json.loads((d / "adapter_config.json").read_text())
    cfg[key] = value
    (d / "adapter_config.json").write_text(json.dumps(cfg))
    with pytest.raises(PolicyError, match=msg):
        load_policy(d)


@pytest.mark.parametrize("changes, match", [
    ({"r": "8"}, r'r must be an integer from 1 to 65536, got the string "8"'),
    ({"lora_alpha": "16"}, r'lora_alpha must be a finite number, got the string "16"'),
    ({"lora_alpha": None}, r"lora_alpha must be a finite number, got null"),
    ({"use_rslora": "yes"}, r'use_rslora must be true or false or null, got the string "yes"'),
    ({"use_dora": 1}, r"use_dora must be true or false or null, got 1"),
    ({"modules_to_save": "lm_head"}, r"modules_to_save must be a list or null, got the string"),
    ({"modules_to_save": [["lm_head"]]}, r"modules_to_save\[0\] must be a string, got a list"),
    ({"alpha_pattern": []}, r"alpha_pattern must be an object or null, got a list"),
    ({"alpha_pattern": {"q_proj": "32"}}, r"alpha_pattern.q_proj must be a finite number"),
    ({"alpha_pattern": {"(q_proj": 32}}, r"alpha_pattern key '\(q_proj' is neither .* regular expression"),
    ({"peft_type": ["LORA"]}, r"peft_type must be a string, got a list"),
    ({"bias": None}, r"bias must be a string, got null"),
    ("7", r"adapter_config.json: must hold a JSON object, got 7"),
    ("[" * 100_000 + "]" * 100_000, r"adapter_config.json: its JSON is nested too deeply"),
])
def test_an_adapter_config_field_of_the_wrong_type_is_refused_by_name(tmp_path, changes, match):
    d = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    path = d / "adapter_config.json"
    path.write_text(changes if isinstance(changes, str) else json.dumps({**json.loads(path.read_text()), **changes}))
    with pytest.raises(PolicyError, match=match) as e:
        load_policy(d)
    assert str(path) in str(e.value)


def test_nulls_where_peft_writes_them_load_as_the_defaults(tmp_path):
    d = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / "pii")
    path = d / "adapter_config.json"
    nulls = dict(use_rslora=None, use_dora=None, fan_in_fan_out=None, modules_to_save=None, alpha_pattern=None)
    path.write_text(json.dumps({**json.loads(path.read_text()), **nulls}))
    assert load_policy(d).lora.scales == load_policy(SAMPLE / "policies" / "pii").lora.scales


def test_policy_json_problems(built, tmp_path):
    d = copy(built, "good", tmp_path)
    (d / "policy.json").unlink()
    with pytest.raises(PolicyError, match="no policy.json"):
        load_policy(d)
    (d / "policy.json").write_text(json.dumps({"name": "x", "labels": {"compliant": "a"}}))
    with pytest.raises(PolicyError, match="missing labels.violation"):
        load_policy(d)
    (d / "policy.json").write_text("{not json")
    with pytest.raises(PolicyError, match="not valid JSON"):
        load_policy(d)
    (d / "policy.json").write_text(json.dumps({"name": "bad name!", "labels": {"compliant": "a", "violation": "b"}}))
    with pytest.raises(PolicyError, match="must be letters"):
        load_policy(d)
    (d / "adapter_model.safetensors").unlink()
    with pytest.raises(PolicyError, match="needs adapter_config.json and adapter_model.safetensors"):
        load_policy(d)


def test_batch_tokens_beyond_32bit_offsets_is_refused_at_load(tmp_path):
    """A batch whose widest activation passes 2^31 elements could not be addressed by the kernels: refused with
    the largest --batch-tokens that works, before any weight is read (a model this wide, so that a --batch-tokens
    within its own limit reaches it)."""
    from policyscan.engine.errors import PolicyscanError
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    widest = 1200  # the intermediate size: wider than hidden (96) and qkv ((6 + 2 * 2) * 16)
    make_model(tmp_path / "wide", "llama", intermediate_size=widest)
    (tmp_path / "zs").mkdir()
    (tmp_path / "zs" / "policy.json").write_text(json.dumps({"name": "zs", "labels": {"compliant": "a",
                                                                                      "violation": "b"}}))
    limit = (2**31 - 1) // widest
    with pytest.raises(PolicyscanError,
                       match=rf"--batch-tokens {limit + 1} is too large.*--batch-tokens {limit} or less"):
        Engine(tmp_path / "wide", load_policies([tmp_path / "zs"]), EngineSettings("cpu", batch_tokens=limit + 1))


def test_in_background_gives_the_value_or_raises_the_error():
    assert in_background(lambda: 7, "test").result(timeout=30) == 7
    with pytest.raises(CheckpointError, match="gone"):
        in_background(lambda: (_ for _ in ()).throw(CheckpointError("gone")), "test").result(timeout=30)
