"""E2E (docs/performance.md): a workload from a Parquet file of text through `policyscan score` to the output Parquet,
against the engine figure (the same model, policies and prompts as token ids, Engine.score_conversations) in
the same run.

    python bench/e2e.py --workload W1 --dir /tmp/e2e [--device cuda]
    python bench/e2e.py --workload W5 --precision fp8,bf16 --hf --hf-batch 1,32 --no-engine   # W5's targets

--precision runs `policyscan score` once per value; --hf adds transformers + PEFT bf16 on the same prompts,
loaded from the same files, in the same call, at each --hf-batch size, and every run's ratio to the fastest.

Stand-ins, since nothing can be downloaded: random bf16 weights saved by transformers and random PEFT adapters
(r = 16 on all seven projections), and the sample model's byte-level BPE tokenizer (vocab 1024) in place of
Llama 3's, with each conversation's text cut to the workload's token length under that tokenizer."""
from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

HERE = Path(__file__).resolve().parent
SAMPLE = HERE.parent / "policyscan" / "sample_data"
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(SAMPLE))
from synth import conversations  # noqa: E402
from workloads import WORKLOADS, hf_peft_model, left_padded, shape, workload_lengths  # noqa: E402

from policyscan.engine.inputs.rows import clip_chars  # noqa: E402
from policyscan.engine.inputs.sources import ReadSpec  # noqa: E402
from policyscan.engine.policy.bundle import load_policies  # noqa: E402
from policyscan.engine.run.pipeline import encoded_inputs  # noqa: E402
from policyscan.engine.run.runner import Engine  # noqa: E402
from policyscan.engine.settings import EngineSettings  # noqa: E402
from policyscan.engine.text.prompts import PolicyPrompts  # noqa: E402

POLICY_PREFIX = "Policy {a}: the assistant must follow rule {a} of the compliance handbook.\nConversation:\n"


def build(root: Path, name: str, device: str) -> None:
    """model/ (config, safetensors, the sample tokenizer) and bundles/p<NN>/ (a PEFT adapter + policy.json)."""
    w = WORKLOADS[name]
    model = hf_peft_model(shape(w.model), w.adapters, device=device)
    model.save_pretrained(root / "bundles", selected_adapters=[f"a{a}" for a in range(w.adapters)])
    for a in range(w.adapters):  # zero-padded: the CLI takes a folder's bundles in name order
        bundle = (root / "bundles" / f"a{a}").rename(root / "bundles" / f"p{a:02d}")
        (bundle / "policy.json").write_text(json.dumps({
            "name": bundle.name, "labels": {"compliant": " Compliant", "violation": " Violation"},
            "template": {"prefix": POLICY_PREFIX.format(a=a), "suffix": "\nVerdict:"},
            "calibration": {"a": 1.0, "b": 0.0}, "threshold": 0.5}))
    base = model.unload()
    base.save_pretrained(root / "model")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SAMPLE / "model" / f, root / "model" / f)
    del model, base
    if device == "cuda":
        torch.cuda.empty_cache()


def write_input(root: Path, name: str, tokenizer) -> Path:
    """One user message per conversation, cut from synthetic chat text to the workload's token lengths."""
    corpus = "".join(m["content"] + "\n" for c in conversations(4000, seed=5) for m in c["messages"])
    ids = tokenizer.encode(corpus, add_special_tokens=False).ids
    texts, off = [], 0
    for n in workload_lengths(WORKLOADS[name]).tolist():
        n -= 3  # the chat template's role tag and newline
        if off + n > len(ids):
            off = 0
        texts.append(tokenizer.decode(ids[off:off + n]))
        off += n
    msgs = pa.array([[{"role": "user", "content": t}] for t in texts],
                    pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())])))
    path = root / f"{name}.parquet"
    pq.write_table(pa.table({"id": [f"c{i}" for i in range(len(texts))], "messages": msgs}), path)
    return path


def engine_figure(root: Path, src: Path, device: str) -> tuple[int, float]:
    """Token ids in, f out: the file read and tokenized as the CLI does it (timed alone: a one-chunk file's rows
    wait for it), then the conversations scored twice (warm-up, then timed)."""
    settings = EngineSettings(device=device, max_length=WORKLOADS[src.stem].max_length)
    engine = Engine(root / "model", load_policies([root / "bundles"]), settings)
    t0 = time.perf_counter()
    chunks = list(encoded_inputs(engine, [src], ReadSpec(max_chars=clip_chars(engine.settings.max_length))))
    print(f"reading and tokenizing {src.name} alone ({len(chunks)} chunk(s)): {time.perf_counter() - t0:.3f} s",
          flush=True)
    convs = [c for _, chunk_convs in chunks for c in chunk_convs]
    engine.score_conversations(convs)  # score_conversations returns host arrays: the GPU is done after each
    t0 = time.perf_counter()
    _, tokens, _ = engine.score_conversations(convs)
    dt = time.perf_counter() - t0
    del engine
    return tokens, dt


def hf_figure(root: Path, src: Path, device: str, batch: int = 32) -> tuple[int, float]:
    """transformers + PEFT bf16 from the checkpoint files on score's own prompts (the same file read and encoded as
    the CLI does): per-policy loop, length-sorted batches of `batch`, left padding, SDPA, logits_to_keep=1, the two
    label logits; LoRA weights cast to bf16 (PEFT keeps them in fp32, 1.56x slower on W1). Timed after a warm-up
    batch. A batch of rows of one length (batch 1 always) has an all-ones mask, which transformers drops, so SDPA
    may take its flash kernel; a padded batch's mask keeps it on another."""
    import transformers as tf
    from peft import PeftModel

    policies = load_policies([root / "bundles"])
    pp = PolicyPrompts.for_policies(root / "model", policies, WORKLOADS[src.stem].max_length)
    chunks = list(encoded_inputs(pp, [src], ReadSpec(max_chars=clip_chars(WORKLOADS[src.stem].max_length))))
    convs = [c for _, chunk_convs in chunks for c in chunk_convs]
    model = tf.AutoModelForCausalLM.from_pretrained(root / "model", dtype=torch.bfloat16, attn_implementation="sdpa")
    first = policies[0].name
    model = PeftModel.from_pretrained(model.to(device), root / "bundles" / first, adapter_name=first)
    for p in policies[1:]:
        model.load_adapter(root / "bundles" / p.name, adapter_name=p.name)
    for n, prm in model.named_parameters():
        if "lora_" in n:
            prm.data = prm.data.to(torch.bfloat16)
    model.eval()

    def run(limit: int | None = None) -> int:
        tokens = 0
        with torch.inference_mode():
            for policy, builder in zip(policies[: 1 if limit else None], pp.builders):
                model.set_adapter(policy.name)
                ids_c, ids_v = pp.encoder.verdict_ids(policy)
                prompts = sorted((builder.build(c)[0] for c in convs[:limit]), key=len)
                for i in range(0, len(prompts), batch):
                    chunk = prompts[i:i + batch]
                    ids, mask = left_padded(chunk)
                    logits = model(input_ids=ids.to(device), attention_mask=mask.to(device), logits_to_keep=1).logits
                    (logits[:, -1, ids_v] - logits[:, -1, ids_c]).float().cpu()
                    tokens += sum(map(len, chunk))
        return tokens

    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    run(limit=max(batch, 8))
    sync()
    t0 = time.perf_counter()
    tokens = run()
    sync()
    return tokens, time.perf_counter() - t0


def cli_figure(root: Path, src: Path, device: str, precision: str = "auto") -> tuple[int, float, float]:
    """`policyscan score` in a fresh process: its own figure (reading, tokenizing, scoring, writing) and the
    process's wall time (adds loading the model, compiling or loading kernels, hashing the checkpoint)."""
    out = root / "out.parquet"
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-m", "policyscan.cli.main", "score", str(src), "-o", str(out),
                          "--model", str(root / "model"), "--policies", str(root / "bundles"),
                          "--device", device, "--max-length", str(WORKLOADS[src.stem].max_length), "--no-progress",
                          "--precision", precision],
                         capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"policyscan score failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    print(res.stdout.strip())
    m = re.search(r"prompt tokens ([\d,]+) in ([\d.]+) s", res.stdout)
    assert pq.read_metadata(out).num_rows == WORKLOADS[src.stem].conversations
    return int(m.group(1).replace(",", "")), float(m.group(2)), wall


def prepare(base: Path, name: str, device: str) -> tuple[Path, Path]:
    """The workload's model and bundles under base/name (built once) and its input file: (root, input)."""
    from tokenizers import Tokenizer

    root = base / name
    if not (root / "model" / "config.json").is_file():
        t0 = time.perf_counter()
        build(root, name, device)
        print(f"built {root} in {time.perf_counter() - t0:.0f} s", flush=True)
    return root, write_input(root, name, Tokenizer.from_file(str(root / "model" / "tokenizer.json")))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="auto", help="comma-separated: one `policyscan score` run for each")
    ap.add_argument("--hf", action="store_true", help="also transformers + PEFT bf16 on the same prompts and files")
    ap.add_argument("--hf-batch", default="32", help="comma-separated batch sizes for --hf, each run; the ratios are "
                                                     "to the fastest")
    ap.add_argument("--no-engine", action="store_true", help="leave out the engine figure (token ids in)")
    args = ap.parse_args()
    root, src = prepare(args.dir, args.workload, args.device)
    rows = []
    if not args.no_engine:
        tokens, dt = engine_figure(root, src, args.device)
        print(f"{args.workload} engine (token ids in): {tokens:,} tokens in {dt:.2f} s = {tokens / dt:,.0f} tok/s",
              flush=True)
        rows.append(("engine, token ids in", tokens, dt, None))
    for precision in args.precision.split(","):
        cli_tokens, cli_s, wall = cli_figure(root, src, args.device, precision)
        print(f"{args.workload} E2E {precision} (policyscan score, Parquet text in and out): {cli_tokens:,} tokens in "
              f"{cli_s:.2f} s = {cli_tokens / cli_s:,.0f} tok/s; process wall {wall:.1f} s", flush=True)
        rows.append((f"policyscan score --precision {precision}", cli_tokens, cli_s, wall))
    hf = []
    for batch in map(int, args.hf_batch.split(",") if args.hf else []):
        tokens, dt = hf_figure(root, src, args.device, batch)
        hf.append((f"transformers + PEFT bf16, batches of {batch}", tokens, dt, None))
    rows += hf
    base = max(tokens / dt for _, tokens, dt, _ in hf) if hf else None
    print(f"\n{args.workload}: {'run':<40}{'tokens':>11}{'seconds':>9}{'tok/s':>10}{'vs HF':>7}{'wall s':>8}")
    for name, tokens, dt, wall in rows:
        ratio = f"{tokens / dt / base:.2f}x" if base else ""
        print(f"{args.workload}: {name:<40}{tokens:>11,}{dt:>9.2f}{tokens / dt:>10,.0f}{ratio:>7}"
              f"{'' if wall is None else f'{wall:.1f}':>8}", flush=True)


if __name__ == "__main__":
    main()
