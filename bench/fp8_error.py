"""Where FP8's error comes from on a real trained model, measured with the CPU W8A8 twin (kernels/reference.py,
the GPU kernels' numerics in torch): each variant keeps part of the network at bf16 and the rest W8A8.

    python bench/smollm2.py /tmp/smollm2 && python bench/fp8_error.py /tmp/smollm2 [--texts 40]

Reference: the fp32 engine (within 1e-4 of transformers fp32, tests/test_engine_vs_hf.py). error =
RMS(f - f_ref) / std(f_ref); flips = verdicts that change at the median of f_ref. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch

from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run.batch import pack
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.kernels import reference

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
GROUPS = ("qkv", "o", "gate_up", "down")
QUESTIONS = ["Does this conversation talk about files?", "Does the assistant give financial advice?",
             "Does the user share a phone number or an address?", "Is the user upset?"]


def policies(root: Path, hidden: int, inter: int, layers: int, heads: int, kv: int, hd: int) -> list[Path]:
    """Prompt-led policies (labels " Yes" / " No") with small random LoRA adapters on every projection: f is
    mostly the real model's own answer to the question."""
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj": (heads * hd, hidden), "k_proj": (kv * hd, hidden), "v_proj": (kv * hd, hidden),
              "o_proj": (hidden, heads * hd), "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    dirs = []
    for i, q in enumerate(QUESTIONS):
        t = {}
        for layer in range(layers):
            for proj, (out, k) in shapes.items():
                key = f"base_model.model.model.layers.{layer}.{'self_attn' if proj[0] in 'qkvo' else 'mlp'}.{proj}"
                t[f"{key}.lora_A.weight"] = torch.randn(8, k, generator=g) * k ** -0.5
                t[f"{key}.lora_B.weight"] = torch.randn(out, 8, generator=g) * 0.02
        d = root / f"q{i}"
        d.mkdir()
        save_file(t, d / "adapter_model.safetensors")
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 8,
                                                          "target_modules": list(shapes)}))
        (d / "policy.json").write_text(json.dumps({
            "name": f"q{i}", "labels": {"compliant": " No", "violation": " Yes"},
            "template": {"prefix": f"Question: {q}\nConversation:\n", "suffix": "\nAnswer (Yes or No):"}}))
        dirs.append(d)
    return dirs


def texts(n: int) -> list[str]:
    rows = pq.read_table(SAMPLE / "conversations.parquet").to_pylist()
    return ["\n".join(f"{m['role']}: {m['content']}" for m in r["messages"]) for r in rows[:n]]


def forward(dec, seqs: list[list[int]], ads: list[int]) -> np.ndarray:
    out = []
    with torch.inference_mode():
        for i in range(0, len(seqs), 16):
            out.append(dec.forward(pack(seqs[i:i + 16], ads[i:i + 16])).double().numpy())
    return np.concatenate(out)


def mixed(w8a8, bf16, keep) -> object:
    """The W8A8 decoder with the (layer, group) pairs in `keep` taken from the bf16 decoder."""
    for layer, group in keep:
        setattr(w8a8.layers[layer], group, getattr(bf16.layers[layer], group))
    return w8a8


def setup(model: str, n_texts: int, first: int = 0):
    """The real model's fp32 engine (the reference) with the policies above, and the (conversation, policy) pairs
    of sample texts [first, first + n_texts): (checkpoint, policies, engine, token ids, adapters, label ids)."""
    ckpt = Checkpoint.open(model)
    c = ckpt.config
    with tempfile.TemporaryDirectory() as tmp:  # the adapters are read into memory at load
        pols = load_policies(policies(Path(tmp), c.hidden, c.intermediate, c.layers, c.heads, c.kv_heads, c.head_dim))
    eng = Engine(model, pols, EngineSettings("cpu", "fp32", prefix_cache=False))
    return (ckpt, pols, eng, *pairs(eng, texts(first + n_texts)[first:]), [eng.encoder.verdict_ids(p) for p in pols])


def pairs(eng: Engine, batch: list[str]) -> tuple[list[list[int]], list[int]]:
    """Every text under every policy: token ids and adapter indices."""
    convs = [np.asarray(x) for x in eng.encoder.encode_batch(batch)]
    return [b.build(cv)[0] for cv in convs for b in eng.builders], [a for _ in convs for a in range(len(eng.builders))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--texts", type=int, default=40)
    args = ap.parse_args()
    ckpt, pols, eng, seqs, ads, labels = setup(args.model, args.texts)
    c = ckpt.config

    def dec(dtype, fp8=False, w8a8=False):
        d = load_decoder(ckpt, reference, Precision(dtype, fp8_weights=fp8, w8a8=w8a8))
        attach_policies(d, pols, labels)
        return d

    ref = forward(eng.decoder, seqs, ads)
    L = c.layers
    variants = {
        "bf16 engine": lambda: dec(torch.bfloat16),
        "FP8 weights only (bf16 activations)": lambda: dec(torch.bfloat16, fp8=True),
        "W8A8 (the GPU default)": lambda: dec(torch.bfloat16, True, True),
        **{f"W8A8, {g} in bf16": (lambda g=g: mixed(dec(torch.bfloat16, True, True), dec(torch.bfloat16),
                                                    [(i, g) for i in range(L)])) for g in GROUPS},
        "W8A8, first and last layer in bf16": lambda: mixed(dec(torch.bfloat16, True, True), dec(torch.bfloat16),
                                                            [(i, g) for i in (0, L - 1) for g in GROUPS]),
        "W8A8, first 2 and last 2 layers in bf16": lambda: mixed(
            dec(torch.bfloat16, True, True), dec(torch.bfloat16), [(i, g) for i in (0, 1, L - 2, L - 1)
                                                                  for g in GROUPS]),
    }
    med = np.median(ref)
    print(f"{len(seqs)} (conversation, policy) pairs, f_ref std {ref.std():.3f}\n", file=sys.stderr)
    print("| variant | error | flips at the median |\n|---|---|---|")
    for name, make in variants.items():
        f = forward(make(), seqs, ads)
        err = np.sqrt(np.mean((f - ref) ** 2)) / ref.std()
        flips = int(((f > med) != (ref > med)).sum())
        print(f"| {name} | {err:.3f} | {flips} |", flush=True)


if __name__ == "__main__":
    main()
