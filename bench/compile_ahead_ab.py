"""Compile-ahead on and off on a fresh machine (docs/performance.md): `policyscan score` in fresh processes, each
on a new empty Triton cache, the two modes alternating, then one warm run; a markdown table last.

    on    as shipped: the kernels compile in parallel processes while the model loads
    off   the same command with compile-ahead switched off inside the process (settings.compile_ahead false
          and no early compilers): each kernel compiles when the first batch needs it

    python bench/compile_ahead_ab.py --workloads W1,W5 [--rounds 2] [--dir /tmp/e2e]"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import prepare  # noqa: E402
from startup import run as score_once  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

OFF = """import sys
import policyscan.engine.warmup.compile_start as start
start.will_compile = lambda argv, env: False
import policyscan.engine.settings as settings
post = settings.EngineSettings.__post_init__
def no_ahead(self):
    post(self)
    object.__setattr__(self, "compile_ahead", False)
settings.EngineSettings.__post_init__ = no_ahead
from policyscan.cli.main import main
sys.argv[0] = "policyscan"
main()
"""


def score(root: Path, src: Path, name: str, mode: str, cache: Path) -> tuple[float, str]:
    head = ("-m", "policyscan.cli.main") if mode == "on" else ("-c", OFF)
    return score_once(root, src, "cuda", cache, ["--max-length", str(WORKLOADS[name].max_length)], head)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workloads", default="W1,W5")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e"))
    args = ap.parse_args()
    rows = []
    for name in args.workloads.split(","):
        root, src = prepare(args.dir, name, "cuda")
        cache = None
        for r in range(args.rounds):
            for mode in ("on", "off") if r % 2 == 0 else ("off", "on"):
                cache = Path(tempfile.mkdtemp(prefix=f"triton_{name}_{mode}_"))
                wall, split = score(root, src, name, mode, cache)
                rows.append((name, f"fresh, compile-ahead {mode}", wall, split))
                print(rows[-1], flush=True)
        wall, split = score(root, src, name, "on", cache)
        rows.append((name, "warm", wall, split))
    print("\n| workload | run | process wall s | summary |\n|---|---|---|---|")
    for name, run, wall, split in rows:
        print(f"| {name} | {run} | {wall:.1f} | {split} |")


if __name__ == "__main__":
    main()
