"""What a fresh process's first scoring call pays: each call's time and the kernel variants Triton loads in it.

    python bench/firstcall.py --dir /tmp/e2e/W1     (after bench/e2e.py has built the dir)

In a fresh process: the load, then the same conversations scored three times; per call, the seconds and the
Triton/Gluon kernel variants first called in it (a load from Triton's disk cache, or a compile). Then the file
twice through the CLI's pipeline (score_inputs), with its accounting of the scoring window."""
from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path

import torch
import triton

from policyscan.engine.inputs.rows import clip_chars
from policyscan.engine.inputs.sources import ReadSpec
from policyscan.engine.outputs.accounting import OutputSpec
from policyscan.engine.policy.bundle import load_policies
from policyscan.engine.run.pipeline import encoded_inputs, score_inputs
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings

MISSES: list[str] = []


def _hook(*args, **kwargs) -> bool:
    """Triton's jit_cache_hook: called for each kernel variant a process calls first; never skips it."""
    MISSES.append(getattr(kwargs.get("fn"), "name", None) or str(kwargs.get("repr", "?")).split("[")[0])
    return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e/W1"))
    args = ap.parse_args()
    triton.knobs.runtime.jit_cache_hook = _hook
    t0 = time.perf_counter()
    engine = Engine(args.dir / "model", load_policies([args.dir / "bundles"]),
                    EngineSettings(device="cuda"))
    rows = [("load", time.perf_counter() - t0, len(MISSES), "")]
    src = args.dir / f"{args.dir.name}.parquet"
    convs = [c for _, cc in encoded_inputs(engine, [src], ReadSpec(max_chars=clip_chars(engine.settings.max_length)))
             for c in cc]
    for i in range(3):
        before = len(MISSES)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        _, tokens, _ = engine.score_conversations(convs)
        dt = time.perf_counter() - t0
        names = Counter(MISSES[before:])
        rows.append((f"score call {i + 1}", dt, len(MISSES) - before,
                     ", ".join(f"{n} x{c}" for n, c in names.most_common())))
    for i in range(2):
        t0 = time.perf_counter()
        acc = score_inputs(engine, [src], Path(f"/tmp/firstcall_{i}.parquet"), Path(f"/tmp/firstcall_{i}.err"),
                           ReadSpec(max_chars=clip_chars(engine.settings.max_length)), OutputSpec())
        rows.append((f"score_inputs {i + 1}", acc.seconds, 0, f"input wait {acc.input_wait_seconds:.3f} s, output "
                     f"{acc.output_seconds:.3f} s, call incl. commit {time.perf_counter() - t0:.3f} s"))
    print(f"{tokens:,} tokens per call")
    print(f"{'step':<20} {'s':>7} {'tok/s':>9} {'new variants':>13}  which")
    for name, dt, n, which in rows:
        tps = f"{tokens / dt:,.0f}" if name.startswith("score") else ""
        print(f"{name:<20} {dt:7.3f} {tps:>9} {n:>13}  {which}")


if __name__ == "__main__":
    main()
