"""Start-up (docs/performance.md): what a nightly job pays before and around scoring, through
`policyscan score` in fresh processes on one workload (bench/e2e.py's model, bundles and Parquet input):

    fresh     Triton's cache empty (TRITON_CACHE_DIR a new folder): a fresh machine
    warm      the same again, cache filled (best of two)
    8 rows    an 8-row file with the cache filled

Each row: the process's wall time, the summary's own split (start-up, load, compile, scoring, the rest) and
the kernel variants in the cache; a markdown table last.

    python bench/startup.py --workload W1 [--dir /tmp/e2e] [--device cuda]"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import prepare  # noqa: E402

SPLIT = re.compile(r"time ([\d.]+) s = (.*)")


def run(root: Path, src: Path, device: str, cache: Path, extra: list[str],
        head: tuple[str, ...] = ("-m", "policyscan.cli.main")) -> tuple[float, str]:
    """`policyscan score` (started as `python HEAD`) in a fresh process on Triton cache `cache`: (wall s, the
    summary's time line)."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    out = root / "startup_out.parquet"
    for stale in (out, out.with_name(out.name + ".errors.jsonl")):
        stale.unlink(missing_ok=True)
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, *head, "score", str(src), "-o", str(out),
                          "--model", str(root / "model"), "--policies", str(root / "bundles"), "--device", device,
                          "--no-progress", *extra], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"policyscan score failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    m = SPLIT.search(res.stdout)
    return wall, m.group(0) if m else res.stdout.strip().splitlines()[-1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="W1")
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cache", type=Path, default=None, help="Triton cache folder to fill (must not exist yet)")
    ap.add_argument("--extra", default="", help="more `policyscan score` arguments, space-separated")
    args = ap.parse_args()
    root, src = prepare(args.dir, args.workload, args.device)
    small = root / "eight.parquet"
    pq.write_table(pq.read_table(src).slice(0, 8), small)
    extra = args.extra.split()
    if args.cache is not None and args.cache.exists():
        raise SystemExit(f"--cache {args.cache} exists: the fresh run needs an empty Triton cache")
    cache = args.cache or Path(tempfile.mkdtemp(prefix="triton_fresh_"))
    rows = []
    wall, split = run(root, src, args.device, cache, extra)
    variants = sum(1 for p in cache.rglob("*.json") if not p.name.startswith("__grp__"))
    rows.append(("fresh (empty Triton cache)", wall, split, variants))
    for i in range(2):
        wall, split = run(root, src, args.device, cache, extra)
        rows.append((f"warm {i + 1}", wall, split, variants))
    wall, split = run(root, small, args.device, cache, extra)
    rows.append(("8 rows, warm", wall, split, variants))
    print(f"\n{args.workload} through `policyscan score` {' '.join(extra)} on {args.device}\n")
    print("| run | process wall s | summary | kernel variants cached |\n|---|---|---|---|")
    for name, wall, split, n in rows:
        print(f"| {name} | {wall:.1f} | {split} | {n} |")


if __name__ == "__main__":
    main()
