"""The CPU path against transformers fp32 (SDPA) + PEFT on the same prompts, idle and beside a busy process.

    python bench/cpu.py [--shape mid|1b] [--prompts N] [--threads N]

A random Llama (mid: hidden 512, 6 layers; 1b: Llama-3.2-1B's shape, 4 layers of it) with one rank-8 LoRA
policy on every projection; seeded prompt lengths (bench/workloads.py). policyscan runs its reference twins
in packed batches (engine's default thread count unless --threads); HF runs each prompt alone (no padding),
on torch's default threads, as a user's script would. "busy" adds a subprocess that spins a 2-thread matmul
for the whole measurement. Prints the median tokens/s over alternating passes and the median ratio policyscan / HF
for each condition."""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "tests"), str(ROOT)]

from hf_fixtures import ALL, AdapterSpec, make_model, make_policy  # noqa: E402

from bench.workloads import lengths  # noqa: E402
from policyscan.engine.model.checkpoint import Checkpoint  # noqa: E402
from policyscan.engine.model.loader import attach_policies, load_decoder  # noqa: E402
from policyscan.engine.model.precision import Precision  # noqa: E402
from policyscan.engine.policy.bundle import load_policy  # noqa: E402
from policyscan.engine.run.batch import pack  # noqa: E402
from policyscan.engine.run.runner import default_threads  # noqa: E402
from policyscan.kernels import cpu_rows, reference  # noqa: E402

SHAPES = {
    "mid": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=6, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, vocab_size=4096, max_position_embeddings=4096),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=4, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, vocab_size=4096, max_position_embeddings=4096),
}
SPIN = "import torch; torch.set_num_threads(2); a = torch.randn(1024, 1024)\nwhile True: a @ a"


def build(root: Path, shape: str) -> tuple[Path, Path]:
    base = make_model(root / "model", "llama", **SHAPES[shape])
    make_policy(base, root / "p0", "p0", AdapterSpec(8, ALL), seed=1)
    return root / "model", root / "p0"


def policyscan_tps(model: Path, policy: Path, seqs: list[list[int]], threads: int) -> float:
    dec = load_decoder(Checkpoint.open(model), reference, Precision(torch.float32), "cpu")
    attach_policies(dec, [load_policy(policy)], [(3, 7)])
    cpu_rows.set_threads(threads)
    batches, cur = [], []
    for s in seqs:  # packed batches of up to 8192 tokens, as engine/run/batch.py plans them
        if cur and sum(map(len, cur)) + len(s) > 8192:
            batches.append(cur)
            cur = []
        cur.append(s)
    batches.append(cur)
    with torch.inference_mode():
        dec.forward(pack(seqs[:1], [0]))  # warm-up
        t0 = time.perf_counter()
        for b in batches:
            dec.forward(pack(b, [0] * len(b)))
        dt = time.perf_counter() - t0
    torch.set_num_threads(os.cpu_count() or 1)  # HF gets torch's default back
    return sum(map(len, seqs)) / dt


def hf_tps(model: Path, policy: Path, seqs: list[list[int]]) -> float:
    import transformers as tf
    from peft import PeftModel

    base = tf.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa")
    m = PeftModel.from_pretrained(base, policy).eval()
    with torch.inference_mode():
        m(input_ids=torch.tensor([seqs[0]]))
        t0 = time.perf_counter()
        for s in seqs:
            m(input_ids=torch.tensor([s]), logits_to_keep=1)
        dt = time.perf_counter() - t0
    return sum(map(len, seqs)) / dt


def measure(model: Path, policy: Path, seqs: list[list[int]], threads: int, busy: bool,
            repeats: int) -> list[tuple[float, float]]:
    """(policyscan, HF) tokens/s, alternating, `repeats` times: a shared machine drifts between passes."""
    spin = subprocess.Popen([sys.executable, "-c", SPIN]) if busy else None
    try:
        if spin is not None:
            time.sleep(1.0)  # the competitor is running before the clock starts
        return [(policyscan_tps(model, policy, seqs, threads), hf_tps(model, policy, seqs)) for _ in range(repeats)]
    finally:
        if spin is not None:
            spin.kill()
            spin.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="mid")
    ap.add_argument("--prompts", type=int, default=24)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=3, help="alternating passes of each; medians are printed")
    args = ap.parse_args()
    threads = args.threads or default_threads()
    g = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 4096, (int(n),), generator=g).tolist() for n in lengths(args.prompts, seed=0)]
    print(f"shape {args.shape}, {len(seqs)} prompts, {sum(map(len, seqs))} tokens, policyscan threads {threads}, "
          f"cpus {len(os.sched_getaffinity(0))}, load average {os.getloadavg()[0]:.2f}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        model, policy = build(Path(tmp), args.shape)
        for busy in (False, True):
            runs = measure(model, policy, seqs, threads, busy, args.repeats)
            ours, theirs = (statistics.median(r[i] for r in runs) for i in (0, 1))
            ratios = ", ".join(f"{o / t:.2f}" for o, t in runs)
            print(f"{'busy' if busy else 'idle'}: policyscan {ours:,.0f} tok/s, HF fp32 SDPA + PEFT {theirs:,.0f} "
                  f"tok/s (medians of {len(runs)}), ratio {statistics.median(o / t for o, t in runs):.2f}x (each "
                  f"pass: {ratios})", flush=True)


if __name__ == "__main__":
    main()
