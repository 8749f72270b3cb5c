"""Prompt-only policies (engine/policy/bundle.py): a bundle with policy.json and no adapter scores the base model
itself, in the same batches as LoRA policies, bitwise as the base model does."""
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from policyscan.cli.main import cli
from policyscan.engine.errors import PolicyError
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.policy.bundle import load_policies, load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
TEXTS = ["user: my SSN is 123-45-6789.\nassistant: noted.", "user: should I buy index funds?",
         "user: hello", "user: what is John's home address?\nassistant: 12 Elm Street." * 3]


def _renamed(tmp_path: Path, name: str, adapter: bool) -> Path:
    """The sample pii policy as `name`, with its adapter or without it (prompt-only)."""
    d = tmp_path / name
    d.mkdir()
    meta = json.loads((SAMPLE / "policies" / "pii" / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, "name": name}))
    if adapter:
        for f in ("adapter_config.json", "adapter_model.safetensors"):
            shutil.copy(SAMPLE / "policies" / "pii" / f, d / f)
    return d


def _zero_b(tmp_path: Path) -> Path:
    """pii's adapter with every lora_B zero: the base model, through the LoRA path."""
    d = _renamed(tmp_path, "zero_b", adapter=True)
    w = load_file(d / "adapter_model.safetensors")
    save_file({k: torch.zeros_like(v) if ".lora_B" in k else v for k, v in w.items()}, d / "adapter_model.safetensors")
    return d


def test_a_bundle_without_adapter_files_is_prompt_only_and_half_an_adapter_is_refused(tmp_path):
    pol = load_policy(_renamed(tmp_path, "zs", adapter=False))
    assert pol.lora.factors == {} and pol.adapter_sha256 is None
    half = _renamed(tmp_path, "half", adapter=False)
    shutil.copy(SAMPLE / "policies" / "pii" / "adapter_config.json", half)
    with pytest.raises(PolicyError, match="needs adapter_config.json and adapter_model.safetensors, or none"):
        load_policy(half)


def test_a_bundle_whose_adapter_is_required_is_refused_without_it(tmp_path):
    d = _renamed(tmp_path, "needs", adapter=True)
    meta = json.loads((d / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, "adapter": "required"}))
    assert load_policy(d).adapter_sha256 is not None
    for f in ("adapter_config.json", "adapter_model.safetensors"):
        (d / f).unlink()
    with pytest.raises(PolicyError, match=r"needs.*adapter is required.*copy adapter_config.json"):
        load_policy(d)
    (d / "policy.json").write_text(json.dumps({**meta, "adapter": "yes"}))
    with pytest.raises(PolicyError, match='adapter must be "required" or "optional"'):
        load_policy(d)


@pytest.mark.parametrize("prefix_cache", [True, False])
def test_prompt_only_f_is_bitwise_the_base_models_mixed_with_lora_policies(tmp_path, prefix_cache):
    settings = EngineSettings("cpu", "fp32", batch_tokens=512, max_length=256, prefix_cache=prefix_cache)
    mixed = load_policies([SAMPLE / "policies" / "pii", _renamed(tmp_path, "zs", adapter=False),
                           SAMPLE / "policies" / "investment_advice"])
    alone = load_policies([_zero_b(tmp_path)])
    only = load_policies([tmp_path / "zs"])
    engines = [Engine(SAMPLE / "model", pols, settings) for pols in (mixed, alone, only)]
    convs = [np.asarray(x) for x in engines[0].encoder.encode_batch(TEXTS)]
    f_mixed, f_alone, f_only = (e.score_conversations(convs)[0] for e in engines)
    assert engines[2].decoder.layers[0].qkv.lora is None  # every policy prompt-only: no LoRA at all
    assert f_mixed[:, 1].tobytes() == f_alone[:, 0].tobytes() == f_only[:, 0].tobytes()
    assert not np.array_equal(f_mixed[:, 0], f_mixed[:, 1])  # the LoRA policy beside it did change its f


def test_score_mixes_prompt_only_and_lora_policies_and_records_no_adapter_hash(tmp_path):
    zs = _renamed(tmp_path, "zs", adapter=False)
    out, log = tmp_path / "o.parquet", tmp_path / "a.jsonl"
    log.write_text("".join((SAMPLE / "conversations.jsonl").read_text().splitlines(keepends=True)[:3]))
    res = CliRunner().invoke(cli, ["score", str(log), "-o", str(out), "--no-progress",
                                   "--device", "cpu", "--policies", str(SAMPLE / "policies" / "pii"),
                                   "--policies", str(zs), "--max-length", "128", "--batch-tokens", "4096"])
    assert res.exit_code == 0, res.output
    recorded = {p["name"]: p["adapter_sha256"] for p in read_metadata(out)["policies"]}
    assert recorded["zs"] is None and len(recorded["pii"]) == 64
    shown = json.loads(CliRunner().invoke(cli, ["inspect", str(zs)]).output)
    assert shown["prompt_only"] is True and shown["lora_ranks"] == [] and shown["adapter_sha256"] is None


def test_factors_for_the_device_leave_a_prompt_only_policy_empty(tmp_path):
    """factors_on's copy for an accelerator (the meta device stands in): a prompt-only policy has no factors to
    copy, and the LoRA policy beside it keeps every factor's shape."""
    from policyscan.engine.model.loader import factors_on

    pols = load_policies([_renamed(tmp_path, "zs", adapter=False), SAMPLE / "policies" / "pii"])
    empty, lora = factors_on(pols, torch.device("meta"))
    assert empty == {}
    assert lora.keys() == pols[1].lora.factors.keys()
    for key, (a, b) in lora.items():
        assert a.shape == pols[1].lora.factors[key][0].shape and b.shape == pols[1].lora.factors[key][1].shape


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_prompt_only_policies_score_on_the_gpu_alone_and_beside_lora_policies(tmp_path, precision):
    """On the GPU, policies without an adapter alone (no LoRA stacks at all) and mixed with LoRA policies: the
    prompt-only column is bitwise the same either way."""
    settings = EngineSettings("cuda", precision, batch_tokens=512, max_length=256)
    mixed = load_policies([SAMPLE / "policies" / "pii", _renamed(tmp_path, "zs", adapter=False)])
    only = load_policies([tmp_path / "zs"])
    engines = [Engine(SAMPLE / "model", pols, settings) for pols in (mixed, only)]
    convs = [np.asarray(x) for x in engines[0].encoder.encode_batch(TEXTS)]
    f_mixed, f_only = (e.score_conversations(convs)[0] for e in engines)
    assert np.isfinite(f_mixed).all() and np.isfinite(f_only).all()
    assert f_mixed[:, 1].tobytes() == f_only[:, 0].tobytes()
