"""`policyscan report` at archive scale: writes a score output of ROWS rows in PARTS outputs (through score's own
writer, in its 4096-row row groups, with the metadata of a real run of the sample), then times the report as a
separate process and prints its wall time and peak RSS.

    python bench/report_scale.py [--rows 10000000] [--parts 10] [--policies 2] [--dir DIR] [--inputs]

--inputs also writes each part's input (short text conversations, the recorded sha256) and runs the report with
--inputs and a review queue, which scans the inputs' id columns for the listed rows."""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.engine.files import file_sha256
from policyscan.engine.outputs.sinks import ScoreWriter, commit_together, read_metadata

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
CHUNK = 4096  # score writes a row group per chunk of this many rows
START = datetime.datetime(2026, 11, 1, tzinfo=datetime.timezone.utc)
# the command run as `policyscan ...` in a process of its own, which prints its peak RSS last on stderr
PEAK = ("import atexit, resource, runpy, sys; sys.argv = ['policyscan', *sys.argv[1:]]; "
        "atexit.register(lambda: print('peak_rss_kib', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, "
        "file=sys.stderr)); runpy.run_module('policyscan.cli.main', run_name='__main__')")


def sample_meta(root: Path) -> dict:
    """The metadata of a real `score` run of the sample, to be adapted for each part."""
    out = root / "sample.scores.parquet"
    subprocess.run([sys.executable, "-m", "policyscan.cli.main", "score", str(SAMPLE / "conversations.parquet"),
                    "-o", str(out), "--raw", "--no-progress"], check=True, capture_output=True)
    meta = read_metadata(out)
    out.unlink()
    return meta


def write_part(path: Path, first: int, rows: int, policies: list[dict], meta: dict, rng: np.random.Generator,
               inp: Path | None) -> None:
    names = [p["name"] for p in policies]
    k = len(names)
    writer = ScoreWriter(path, "parquet", "wide", names, raw=True)
    flagged = np.zeros(k, dtype=np.int64)
    texts = pq.ParquetWriter(inp, pa.schema([("id", pa.string()), ("text", pa.string()),
                                              ("ts", pa.timestamp("us", "UTC"))])) if inp else None
    for lo in range(0, rows, CHUNK):
        n = min(CHUNK, rows - lo)
        ids = pa.array([f"conv-{first + lo + i:09d}" for i in range(n)], pa.string())
        violates = rng.random((n, k)) < 0.03
        f = np.where(violates, rng.normal(3.0, 1.5, (n, k)), rng.normal(-4.0, 1.5, (n, k)))
        p = 1.0 / (1.0 + np.exp(-f))
        flagged += (p >= 0.5).sum(axis=0)
        seconds = (first + lo + np.arange(n)) * (30 * 86400 // 10_000_000)  # 30 days per ten million rows
        ts = pa.array((START.timestamp() + seconds) * 1_000_000, pa.int64()).cast(pa.timestamp("us", "UTC"))
        writer.write(ids, {"ts": ts}, p, f)
        if texts is not None:
            body = pa.array([f"user: question {first + lo + i} about my account\nassistant: here is the answer"
                             for i in range(n)], pa.string())
            texts.write_table(pa.table({"id": ids, "text": body, "ts": ts}))
    if texts is not None:
        texts.close()
    acc = {**meta["accounting"], "rows_in": rows, "rows_scored": rows, "rows_in_errors": 0, "balanced": True,
           "above_threshold": dict(zip(names, map(int, flagged)))}
    record = {"path": str(inp), "abs_path": str(inp.resolve()), "rel_path": f"../inputs/{inp.name}",
              "sha256": file_sha256(inp), "changed_while_read": False} if inp else \
        {"path": f"part-{first}.parquet", "abs_path": f"/nonexistent/part-{first}.parquet", "rel_path": "x",
         "sha256": None, "changed_while_read": False}
    part_meta = {**meta, "policies": policies, "accounting": acc, "inputs": [record],
                 "read": {**meta["read"], "keep": ["ts"]}, "output": {**meta["output"], "raw": True}}
    commit_together(writer.finish(part_meta), [])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=10_000_000)
    ap.add_argument("--parts", type=int, default=10)
    ap.add_argument("--policies", type=int, default=2, help="policies per row (copies of the sample's)")
    ap.add_argument("--dir", type=Path, default=None, help="where to write [default: a temporary folder]")
    ap.add_argument("--inputs", action="store_true", help="write the inputs too; report with --inputs --review")
    args = ap.parse_args()
    root = args.dir or Path(tempfile.mkdtemp(prefix="policyscan_report_scale_"))
    (root / "outputs").mkdir(parents=True, exist_ok=True)
    (root / "inputs").mkdir(exist_ok=True)
    meta = sample_meta(root)
    base = meta["policies"]
    policies = [{**base[i % len(base)], "name": base[i % len(base)]["name"] + ("" if i < len(base) else f"_{i}")}
                for i in range(args.policies)]
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    per = -(-args.rows // args.parts)
    for i in range(args.parts):
        lo = i * per
        n = min(per, args.rows - lo)
        inp = root / "inputs" / f"part-{i:03d}.parquet" if args.inputs else None
        write_part(root / "outputs" / f"part-{i:03d}.scores.parquet", lo, n, policies, meta, rng, inp)
    size = sum(p.stat().st_size for p in (root / "outputs").iterdir())
    print(f"wrote {args.rows:,} rows, {args.policies} policies, in {args.parts} outputs ({size / 2**20:.0f} MiB) in "
          f"{time.perf_counter() - t0:.1f} s: {root / 'outputs'}")
    cmd = [sys.executable, "-m", "policyscan.cli.main", "report", str(root / "outputs"), "-o",
           str(root / "report.html"), "--time-column", "ts", "--top", "20"]
    if args.inputs:
        cmd += ["--inputs", "--review", str(root / "review.parquet"), "--review-rows", "100"]
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", PEAK, *cmd[3:]], capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(res.stdout + res.stderr)
    peak = int(res.stderr.strip().splitlines()[-1].split()[-1]) / 1024  # KiB -> MiB
    print(res.stdout.strip())
    print(json.dumps({"rows": args.rows, "parts": args.parts, "policies": args.policies, "inputs": args.inputs,
                      "report_wall_s": round(wall, 2), "report_peak_rss_mib": round(peak, 1),
                      "page_kib": round((root / "report.html").stat().st_size / 1024, 1)}))


if __name__ == "__main__":
    main()
