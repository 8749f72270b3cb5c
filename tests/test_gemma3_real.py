"""A real Gemma 3: Gemma 3 270M as bench/gemma3_checkpoint.py converts it once into the test cache
($POLICYSCAN_TEST_CACHE, else ~/.cache/policyscan-tests; .ci/run fetches it when it can). Real English conversations
through `policyscan score` on the CPU against transformers fp32 on the tokenizer's encoding of each whole prompt:
two zero-shot (prompt-only) policies, and a LoRA policy and a policy `policyscan train` wrote against transformers +
PEFT; on a GPU, bf16 and FP8 against the fp32 engine. Skipped, with how to get the checkpoint, where it is absent."""
from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from cli_cases import run

ROOT = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("POLICYSCAN_TEST_CACHE", Path.home() / ".cache" / "policyscan-tests"))
MODEL = CACHE / "gemma3-270m"
QUESTIONS = {"files": "Does this conversation talk about files?", "money": "Does the user ask about money?"}
LORA = "lora"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gemma3() -> Path:
    if not ((MODEL / "config.json").is_file() and (MODEL / "model.safetensors").is_file()):
        pytest.skip(f"no converted Gemma 3 270M checkpoint in {MODEL}: `python bench/gemma3_checkpoint.py {MODEL}` "
                    "fetches and converts it once (network, the gguf package)")
    return MODEL


def texts(n: int) -> list[str]:
    rows = pq.read_table(ROOT / "policyscan" / "sample_data" / "conversations.parquet").slice(0, n).to_pylist()
    return ["\n".join(f"{m['role']}: {m['content']}" for m in r["messages"]) for r in rows]


def template(question: str) -> dict:
    return {"prefix": f"Question: {question}\nConversation:\n", "suffix": "\nAnswer (Yes or No):"}


@pytest.fixture(scope="module")
def hf_model(gemma3):
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(gemma3, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def scored(gemma3, hf_model, tmp_path_factory) -> tuple[dict, Path]:
    """`policyscan score` (CPU, fp32, --raw) of four conversations under the two questions and a LoRA policy (a random
    PEFT adapter on q, v, o and down, asking the money question): the output's columns, and the policies' folder."""
    from peft import LoraConfig, get_peft_model

    root = tmp_path_factory.mktemp("gemma3-real")
    policies = root / "policies"
    torch.manual_seed(0)
    peft_model = get_peft_model(hf_model, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, lora_dropout=0.0,
                                                     target_modules=["q_proj", "v_proj", "o_proj", "down_proj"]))
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.mul_(0.05)  # an adapter that moves f by about its own spread, not one that drowns the model
    peft_model.save_pretrained(policies / LORA)
    peft_model.unload()
    for name, question in [*QUESTIONS.items(), (LORA, QUESTIONS["money"])]:
        (policies / name).mkdir(exist_ok=True)
        (policies / name / "policy.json").write_text(json.dumps({
            "name": name, "labels": {"compliant": " No", "violation": " Yes"}, "template": template(question)}))
    src, out = root / "chats.parquet", root / "scores.parquet"
    pq.write_table(pa.table({"id": [f"c{i}" for i in range(4)], "text": texts(4)}), src)
    run("score", src, "-o", out, "--model", gemma3, "--policies", policies, "--device", "cpu", "--raw",
        "--no-progress")
    return pq.read_table(out).to_pydict(), policies


def whole_prompt_f(model, gemma3: Path, question: str) -> np.ndarray:
    """f of each conversation from the model on the tokenizer's encoding of the whole prompt, BOS included."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(gemma3 / "tokenizer.json"))
    t = template(question)
    no, yes = (tok.encode(label, add_special_tokens=False).ids[0] for label in (" No", " Yes"))
    out = []
    with torch.no_grad():
        for text in texts(4):
            ids = tok.encode(t["prefix"] + text + t["suffix"], add_special_tokens=True).ids
            assert ids[0] == tok.token_to_id("<bos>")
            logits = model(input_ids=torch.tensor([ids]), logits_to_keep=1).logits[0, -1].double()
            out.append((logits[yes] - logits[no]).item())
    return np.array(out)


def test_score_matches_transformers_on_real_gemma3(gemma3, hf_model, scored):
    got, _ = scored
    for name, question in QUESTIONS.items():
        ref = whole_prompt_f(hf_model, gemma3, question)
        f = np.asarray(got[f"f_{name}"], dtype=np.float64)
        err = np.abs(f - ref).max()
        print(f"Gemma 3 270M {name!r} through score vs transformers fp32: max |f - f_hf| {err:.2e}, "
              f"f {ref.round(3).tolist()}")
        assert err <= 1e-4
    assert np.std([got[f"f_{n}"] for n in QUESTIONS]) > 0.1  # a real comparison, not of constants


def test_a_lora_on_real_gemma3_scores_as_peft(gemma3, hf_model, scored):
    from peft import PeftModel

    got, policies = scored
    model = PeftModel.from_pretrained(hf_model, policies / LORA).eval()
    ref = whole_prompt_f(model, gemma3, QUESTIONS["money"])
    model.unload()
    f, base = (np.asarray(got[f"f_{n}"], dtype=np.float64) for n in (LORA, "money"))
    err = np.abs(f - ref).max()
    print(f"Gemma 3 270M LoRA through score vs transformers + PEFT fp32: max |f - f_hf| {err:.2e}; the adapter moves "
          f"f by {np.abs(f - base).mean():.3f} on average")
    assert np.abs(f - base).min() > 1e-2  # the adapter is applied, not skipped
    assert err <= 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_on_real_gemma3_within_its_cpu_twin(gemma3, tmp_path, precision):
    """The GPU kernels on Gemma 3 270M against the fp32 engine: no further from it than the CPU path of the same
    numerics (the bf16 engine, or the W8A8 twin) is, with room for another summation order (1.5x), as for SmolLM2
    (test_real_model.py)."""
    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    for name, question in QUESTIONS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "policy.json").write_text(json.dumps({
            "name": name, "labels": {"compliant": " No", "violation": " Yes"}, "template": template(question)}))
    pols = load_policies([tmp_path])
    cpu = Engine(gemma3, pols, EngineSettings("cpu", "fp32"))
    convs = [np.asarray(x) for x in cpu.encoder.encode_batch(texts(40))]
    ref = cpu.score_conversations(convs)[0].astype(np.float64)
    del cpu
    twin = Engine(gemma3, pols, EngineSettings("cpu", precision)).score_conversations(convs)[0]
    gpu = Engine(gemma3, pols, EngineSettings("cuda", precision)).score_conversations(convs)[0]
    errs = {k: float(np.sqrt(np.mean((f.astype(np.float64) - ref) ** 2)) / ref.std())
            for k, f in (("gpu", gpu), ("cpu twin", twin))}
    print(f"Gemma 3 270M {precision}, {ref.size} pairs, RMS(f - f_fp32) / std: gpu {errs['gpu']:.3f}, "
          f"cpu twin {errs['cpu twin']:.3f}")
    assert np.isfinite(gpu).all()
    assert errs["gpu"] <= 1.5 * errs["cpu twin"]


def test_train_on_real_gemma3_writes_an_adapter_that_scores_as_trained(gemma3, hf_model, tmp_path):
    """`policyscan train` on Gemma 3 270M (the CPU, fp32; the sample's pii rule, 20 rows of each label cut to 64
    tokens, r 2 on q and v, one epoch: a test of the path, not of learning): train's own check of score's engine
    against the trainer holds, and transformers + PEFT loading the written adapter from its files gives score's f."""
    from peft import PeftModel

    labeled, policy = tmp_path / "labeled.parquet", tmp_path / "pii"
    rows = pq.read_table(ROOT / "policyscan" / "sample_data" / "labeled.parquet").to_pylist()
    pq.write_table(pa.Table.from_pylist([r for r in rows if r["pii"]][:20] + [r for r in rows if not r["pii"]][:20]),
                   labeled)
    policy.mkdir()
    question = "Does the user share personal information such as an email address or a phone number?"
    (policy / "policy.json").write_text(json.dumps({
        "name": "pii", "labels": {"compliant": " No", "violation": " Yes"}, "template": template(question)}))
    run("train", labeled, "--model", gemma3, "--policy", policy, "--label-column", "pii", "--max-length", "64",
        "--rank", "2", "--targets", "q,v", "--epochs", "1", "--lr", "1e-3", "--holdout", "0.3", "--device", "cpu",
        "--chat-template", "plain", "--no-progress")
    training = json.loads((policy / "policy.json").read_text())["training"]
    assert training["parity"]["max_abs_diff"] <= 1e-4 and training["precision"] == "fp32"

    src, out = tmp_path / "chats.parquet", tmp_path / "scores.parquet"
    pq.write_table(pa.table({"id": [f"c{i}" for i in range(4)], "text": texts(4)}), src)
    run("score", src, "-o", out, "--model", gemma3, "--policies", policy, "--device", "cpu", "--raw",
        "--no-progress")
    f = np.asarray(pq.read_table(out)["f_pii"].to_pylist(), dtype=np.float64)
    base = whole_prompt_f(hf_model, gemma3, question)
    model = PeftModel.from_pretrained(hf_model, policy).eval()
    ref = whole_prompt_f(model, gemma3, question)
    model.unload()
    err = np.abs(f - ref).max()
    print(f"Gemma 3 270M, a policy trained by `policyscan train`: score vs transformers + PEFT fp32 max |f - f_hf| "
          f"{err:.2e}; training moved f by {np.abs(ref - base).mean():.3f} on average")
    assert np.abs(ref - base).min() > 1e-3  # the trained adapter is applied, not a zero update
    assert err <= 1e-4
