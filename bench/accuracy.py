"""Accuracy on the W4 (Llama-3.2-1B) shape: the GPU engine (bf16, FP8) and the CPU reference against
transformers + PEFT, same random checkpoint, same adapters, same token ids.

    python bench/accuracy.py         (on the GPU machine; writes a checkpoint to /tmp)
    python bench/accuracy.py cpu     (CPU only: fp32 and the W8A8 twin, the FP8 error the same-precision
                                      torch computation makes; another random model, CPU RNG)"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from hf_fixtures import hf_scores  # noqa: E402

from policyscan.engine.model.checkpoint import Checkpoint  # noqa: E402
from policyscan.engine.model.loader import attach_policies, load_decoder  # noqa: E402
from policyscan.engine.model.precision import Precision  # noqa: E402
from policyscan.engine.policy.bundle import load_policy  # noqa: E402
from policyscan.engine.run.batch import pack  # noqa: E402

LABELS = [(11, 13), (21, 23), (31, 37)]
LENGTHS = [1, 17, 64, 200, 333, 100, 5, 250, 48]


def build(root: Path, device: str) -> list[Path]:
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    cfg = tf.LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072, rms_norm_eps=1e-5,
                         rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 8192})
    torch.manual_seed(0)
    with torch.device(device):
        model = tf.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(root / "model")
    dirs = []
    every = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for i, (r, targets) in enumerate([(16, every), (1, ["q_proj", "v_proj"]), (8, ["o_proj", "down_proj", "up_proj"])]):
        torch.manual_seed(10 + i)
        peft = get_peft_model(model, LoraConfig(r=r, lora_alpha=2 * r, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():
            for n, p in peft.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.05)
        peft.save_pretrained(root / f"p{i}")
        peft.unload()
        (root / f"p{i}" / "policy.json").write_text(json.dumps({"name": f"p{i}", "labels": {"compliant": "a",
                                                                                            "violation": "b"}}))
        dirs.append(root / f"p{i}")
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return dirs


def ours(model_dir: Path, dirs: list[Path], seqs, ads, device: str, dtype, fp8: bool, w8a8: bool) -> torch.Tensor:
    from policyscan.kernels import reference

    if device == "cuda":
        from policyscan.kernels import triton_ops as ops
    else:
        ops = reference
    dec = load_decoder(Checkpoint.open(model_dir), ops, Precision(dtype, fp8, w8a8), device)
    attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
    with torch.inference_mode():
        f = dec.forward(pack(seqs, ads).to(device)).double().cpu()
    del dec
    if device == "cuda":
        torch.cuda.empty_cache()
    return f


def main() -> None:
    dev = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    root = Path(tempfile.mkdtemp())
    dirs = build(root, dev)
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 128256, (n,), generator=g).tolist() for n in LENGTHS]
    ads = sorted(i % 3 for i in range(len(seqs)))
    torch.backends.cuda.matmul.allow_tf32 = False
    ref = hf_scores(root / "model", dirs, seqs, ads, LABELS, torch.float32, dev)  # fp32, no TF32: the reference
    m = root / "model"
    if dev == "cuda":
        rows = {"HF + PEFT bf16": hf_scores(m, dirs, seqs, ads, LABELS, torch.bfloat16, "cuda"),
                "policyscan CPU fp32": ours(m, dirs, seqs, ads, "cpu", torch.float32, False, False),
                "policyscan GPU bf16": ours(m, dirs, seqs, ads, "cuda", torch.bfloat16, False, False),
                "policyscan GPU FP8": ours(m, dirs, seqs, ads, "cuda", torch.bfloat16, True, True)}
    else:  # the W8A8 twin: the GPU FP8 path's quantization of weights and activations, in torch on the CPU
        rows = {"policyscan CPU fp32": ours(m, dirs, seqs, ads, "cpu", torch.float32, False, False),
                "policyscan CPU W8A8 twin": ours(m, dirs, seqs, ads, "cpu", torch.bfloat16, True, True)}
    print(f"W4 shape, {len(seqs)} sequences ({sum(LENGTHS)} tokens), 3 adapters; reference: HF + PEFT fp32, "
          f"|f| mean {ref.abs().mean():.3f}")
    for name, f in rows.items():
        dp = (torch.sigmoid(f) - torch.sigmoid(ref)).abs()
        df = (f - ref).abs()
        print(f"  {name:<22} max |dp| {dp.max():.2e}  mean |dp| {dp.mean():.2e}  max |df| {df.max():.2e}")


if __name__ == "__main__":
    main()
