"""Training throughput and peak memory (docs/performance.md): `policyscan train`'s loop (length-bucketed batches
under a token budget, the two-row verdict head, gradient checkpointing, bf16 autocast) against a plain
transformers + PEFT loop (a fixed batch size padded to its longest row, random order, the vocabulary's logits and
the label token's cross-entropy, gradient checkpointing too), on the same rows, in the same call.

    python bench/train.py --shape 3b --rows 512          W1's shape, conversations of W1's lengths (up to 2k)
    python bench/train.py --shape 8b --rows 96 --longest 4096 --median 1000

Random weights and random token ids: speed and memory do not depend on the values. One epoch each, after a
warm-up of a few steps; tokens/s counts real (unpadded) tokens."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import lengths, shape  # noqa: E402

from policyscan.training.data import Example  # noqa: E402
from policyscan.training.loop import LoopSettings, batches, fit, padded  # noqa: E402
from policyscan.training.verdict import LoraSpec, VerdictModel  # noqa: E402

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU: a dry run of this script on the tiny shape


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak() -> float:
    return torch.cuda.max_memory_allocated() / 2**30 if DEV == "cuda" else 0.0


def base_model(name: str):
    import transformers as tf

    cfg = shape(name)
    hcfg = tf.LlamaConfig(hidden_size=cfg.hidden, intermediate_size=cfg.intermediate, num_hidden_layers=cfg.layers,
                          num_attention_heads=cfg.heads, num_key_value_heads=cfg.kv_heads, head_dim=cfg.head_dim,
                          vocab_size=cfg.vocab, rms_norm_eps=cfg.rms_eps, tie_word_embeddings=True,
                          max_position_embeddings=131072, attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(DEV):
        torch.set_default_dtype(torch.bfloat16)
        model = tf.LlamaForCausalLM(hcfg)
        torch.set_default_dtype(torch.float32)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model, cfg.vocab


def rows(n: int, vocab: int, median: int, longest: int) -> list[Example]:
    rng = np.random.default_rng(0)
    return [Example(i, tuple(rng.integers(0, vocab, int(k)).tolist()), int(rng.integers(0, 2)), False, "")
            for i, k in enumerate(lengths(n, 0, median, 0.8, longest))]


def ours(model, examples: list[Example], budget: int) -> tuple[float, int, float]:
    vm = VerdictModel(model, (11, 13), LoraSpec(16, 32.0), seed=0)
    settings = LoopSettings(epochs=1, lr=1e-4, batch_tokens=budget, patience=1)
    fit(vm, examples[:32], examples[:4], settings, torch.bfloat16)  # warm-up: kernels, allocator
    sync()
    t0 = time.perf_counter()
    result = fit(vm, examples, examples[:4], settings, torch.bfloat16)
    dt = time.perf_counter() - t0
    mem = peak()
    vm.peft.unload()  # the base back without the adapter's layers, for the plain loop
    return dt, result.tokens, mem


def plain(model, examples: list[Example], batch_size: int) -> tuple[float, int, float]:
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    peft = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=list(LoraSpec().targets)))
    opt = torch.optim.AdamW([p for p in peft.parameters() if p.requires_grad], lr=1e-4)
    order = np.random.default_rng(1).permutation(len(examples)).tolist()
    plan = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
    label = torch.tensor([11, 13], device=DEV)

    def step(rows_):
        # the label token appended: the LM loss of the label at the prompt's end, over the whole vocabulary
        ex = [Example(0, e.ids + (int(label[e.label]),), e.label, False, "") for e in (examples[i] for i in rows_)]
        ids, mask, last = padded(ex, list(range(len(ex))), torch.device(DEV))
        with torch.autocast(DEV, dtype=torch.bfloat16):
            logits = peft(input_ids=ids, attention_mask=mask).logits
        pred = logits[torch.arange(len(ex), device=DEV), last - 1].float()
        loss = torch.nn.functional.cross_entropy(pred, ids[torch.arange(len(ex), device=DEV), last])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return int(mask.sum()) - len(ex)

    peft.train()
    for rows_ in plan[:2]:
        step(rows_)
    sync()
    t0, tokens = time.perf_counter(), 0
    for rows_ in plan:
        tokens += step(rows_)
    if DEV == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, tokens, peak()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="3b")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--median", type=int, default=250)
    ap.add_argument("--longest", type=int, default=2048)
    ap.add_argument("--budget", type=int, default=16384, help="train's --batch-tokens")
    ap.add_argument("--batch-size", type=int, default=8, help="the plain loop's rows per batch")
    args = ap.parse_args()
    model, vocab = base_model(args.shape)
    examples = rows(args.rows, vocab, args.median, args.longest)
    print(f"{args.shape}: {len(examples)} rows, {sum(len(e.ids) for e in examples):,} tokens, "
          f"{len(batches(examples, args.budget))} train batches of <= {args.budget} tokens", flush=True)
    a = ours(model, examples, args.budget)
    b = plain(model, examples, args.batch_size)
    print("\n| loop | seconds | tokens | tokens/s | peak GiB |\n|---|---|---|---|---|")
    for name, (dt, tokens, mem) in (("policyscan train", a), (f"plain HF + PEFT, batch {args.batch_size}", b)):
        print(f"| {name} | {dt:.1f} | {tokens:,} | {tokens / dt:,.0f} | {mem:.1f} |")
    print(f"\n{args.shape}: train {a[1] / a[0] / (b[1] / b[0]):.2f}x the plain loop's tokens/s")


if __name__ == "__main__":
    main()
