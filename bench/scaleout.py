"""Scale-out overhead (docs/performance.md): one workload through `policyscan score` three ways in one call, each
in a fresh process on one GPU, against the in-process path:

    (a) cli      `policyscan score`, scoring in its own process (what `score` does on one GPU)
    (b) workers  the local multi-worker path (engine/parallel/workers.py) with one GPU worker
    (c) ray      `policyscan score --ray` on a local Ray cluster of one GPU (one actor)

Each: the process's wall time and its summary's own tokens/s; every output's p_ columns bitwise those of the
first path (by id); a markdown table last.

    python bench/scaleout.py --workload W1 [--dir /tmp/e2e] [--paths cli,workers,ray]
    python bench/scaleout.py --workload T1 --device cpu      # a dry run on a CPU (one worker, one CPU actor)
    python bench/scaleout.py --workload W1 --scale 4         # W1's conversations 4 times over (ids made unique)

The model, bundles and Parquet input are bench/e2e.py's (its prepare(); the same --dir shares
its model). An untimed `policyscan score` first fills Triton's disk cache and the page cache, so no path pays
for compiling kernels or reading the checkpoint from disk.

(b) The CLI scores a single GPU in its own process and takes the worker path only for several devices. So (b)
is `policyscan score` with cli.score._worker_devices answering the one device: the CLI's own settings, chat
template, WorkerPool, score_inputs_workers, summary and metadata, with only that choice forced (the run is
checked to have said "[1 workers: ...]"), and its workers' fork server started as the command line starts it when
it will run workers (engine/parallel/worker_start.py). No CLI option does this: one worker on one GPU only costs a user.
(c) The Ray cluster starts in this process before (c) is timed, as a cluster runs before its jobs; its start-up
is printed apart. Every process sees one GPU (CUDA_VISIBLE_DEVICES), the cluster included.

Reading the tokens/s: (a)'s scoring clock starts once its model is loaded, while (b)'s and (c)'s start as the
worker or actor begins loading its own (the run waits for it), so their tokens/s include a model load; the wall
times are the like-for-like figure."""
from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from e2e import prepare  # noqa: E402
from workloads import WORKLOADS  # noqa: E402

LABELS = {"cli": "(a) policyscan score, in-process", "workers": "(b) local workers, 1 worker",
          "ray": "(c) policyscan score --ray, 1 actor"}
# Every path is launched alike, from a script file as the console script is (its workers re-import it as their
# parent's main module); (b) with the CLI's device choice answering one worker (see the docstring) and the fork
# server started first, as the command line starts it when it will run workers (engine/parallel/worker_start.py)
MAIN = "import policyscan.cli.main as m\nif __name__ == '__main__':\n    m.main()\n"
WORKERS_MAIN = ("import policyscan.engine.parallel.worker_start as w\nw.prestart(['score', '--devices', 'all'])\n"
                "import policyscan.cli.main as m, policyscan.cli.score as s\n"
                "s._worker_devices = lambda device, devices, workers: ('cpu',) if device == 'cpu' else ('0',)\n"
                "if __name__ == '__main__':\n    m.main()\n")
# what each path says on stderr when it runs as intended: in-process, one worker, one actor
BANNER = {"cli": re.compile(r"\[\w+, [^\]]+, (cpu|cuda(:0)?)\]"),
          "workers": re.compile(r"\[1 workers: (cpu|cuda:0)\]"), "ray": re.compile(r"\[Ray: up to 1 actor, ")}
SUMMARY = re.compile(r"prompt tokens ([\d,]+) in ([\d.]+) s")


@dataclass(frozen=True)
class Result:
    path: str
    output: Path
    tokens: int
    seconds: float  # the summary's scoring time
    wall: float  # the whole process

    @property
    def tps(self) -> float:
        return self.tokens / self.seconds


def run_path(path: str, root: Path, src: Path, device: str, address: str | None = None, run: str = "") -> Result:
    """One `policyscan score` in a fresh process, timed from launch to exit; its output named by `run` (each run
    of a path kept, for the comparison after them all)."""
    out = root / f"scaleout-{run or path}.parquet"
    for f in (out, out.with_name(out.name + ".errors.jsonl")):  # so the bits compared are this run's
        f.unlink(missing_ok=True)
    launcher = root / f"scaleout_{path}.py"
    launcher.write_text(WORKERS_MAIN if path == "workers" else MAIN)
    cmd = [sys.executable, str(launcher), "score", str(src), "-o", str(out),
           "--model", str(root / "model"), "--policies", str(root / "bundles"), "--device", device, "--no-progress",
           *(["--ray", "--ray-address", address] if address else [])]
    t0 = time.perf_counter()
    res = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"{LABELS[path]} failed ({res.returncode}):\n{res.stdout}\n{res.stderr}")
    if not BANNER[path].search(res.stderr):
        raise SystemExit(f"{LABELS[path]} did not run as intended (no {BANNER[path].pattern!r}):\n{res.stderr}")
    for line in res.stdout.splitlines():  # where (a)'s wall time went; a worker or actor that died
        if line.startswith(("time ", "worker processes that died")):
            print(f"  {path}: {line}", flush=True)
    m = SUMMARY.search(res.stdout)
    assert pq.read_metadata(out).num_rows == pq.read_metadata(src).num_rows
    return Result(path, out, int(m.group(1).replace(",", "")), float(m.group(2)), wall)


def p_columns(path: Path) -> tuple[list, dict[str, bytes]]:
    """The ids in order and each p_ column's bytes, rows sorted by id (Ray's path is keyed by id)."""
    t = pq.read_table(path).sort_by("id")
    return t["id"].to_pylist(), {c: t[c].to_numpy().tobytes() for c in t.column_names if c.startswith("p_")}


def start_ray(device: str) -> str:
    """A local Ray cluster of one GPU (on the CPU: none) owned by this process; its address."""
    import ray

    t0 = time.perf_counter()
    ray.init(num_gpus=int(device == "cuda"), include_dashboard=False, logging_level=logging.WARNING)
    address = ray.get_runtime_context().gcs_address
    print(f"local Ray cluster at {address} ({ray.cluster_resources().get('GPU', 0):g} GPU) started in "
          f"{time.perf_counter() - t0:.1f} s, before (c)'s clock", flush=True)
    return address


def scaled(src: Path, n: int) -> Path:
    """The input `n` times over in one file, each copy's ids suffixed #k: a longer job on the same model, where a
    path's fixed start-up weighs less."""
    if n == 1:
        return src
    out = src.with_name(f"{src.stem}x{n}.parquet")
    t = pq.read_table(src)
    ids = t["id"].cast(pa.string())
    copies = [t.set_column(t.schema.get_field_index("id"), "id", pc.binary_join_element_wise(ids, f"#{k}", ""))
              for k in range(n)]
    pq.write_table(pa.concat_tables(copies), out)
    return out


def table(results: list[Result]) -> str:
    ref = results[0]
    tag = LABELS[ref.path][:3]  # "(a)" unless --paths starts elsewhere
    rows = [f"| path | tokens/s | wall s | tokens/s vs {tag} | wall vs {tag} |", "|---|---|---|---|---|"]
    for r in results:
        rows.append(f"| {LABELS[r.path]} | {r.tps:,.0f} | {r.wall:.1f} | {r.tps / ref.tps:.3f}x | "
                    f"{r.wall / ref.wall:.3f}x |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="W1", choices=sorted(WORKLOADS))
    ap.add_argument("--dir", type=Path, default=Path("/tmp/e2e"), help="shared with bench/e2e.py: one model build")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--scale", type=int, default=1, help="score the workload's input this many times over")
    ap.add_argument("--paths", default="cli,workers,ray",
                    help="a subset of cli,workers,ray, run in this order; the first is the reference")
    args = ap.parse_args()
    paths = [p.strip() for p in args.paths.split(",") if p.strip()]
    if not paths or set(paths) - set(LABELS):
        ap.error(f"--paths: a comma-separated subset of {','.join(LABELS)}")
    if args.scale < 1:
        ap.error("--scale: 1 or more")
    if "ray" in paths and importlib.util.find_spec("ray") is None:  # say so before minutes of other runs
        ap.error("--paths ray needs Ray Data: pip install 'policyscan[ray]'")
    if args.device == "cuda":  # one GPU for every path (and the Ray cluster) on a host with more
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    root, src = prepare(args.dir, args.workload, args.device)
    src = scaled(src, args.scale)
    warm = run_path("cli", root, src, args.device)
    print(f"warm-up (untimed): policyscan score in {warm.wall:.1f} s", flush=True)

    results = []
    for path in paths:
        address = start_ray(args.device) if path == "ray" else None
        try:
            r = run_path(path, root, src, args.device, address, f"{len(results)}-{path}")
        finally:
            if address:
                import ray

                ray.shutdown()
        print(f"{LABELS[r.path]}: {r.tokens:,} tokens in {r.seconds:.2f} s = {r.tps:,.0f} tokens/s; "
              f"process wall {r.wall:.1f} s", flush=True)
        results.append(r)

    ids, ref = p_columns(results[0].output)
    for r in results[1:]:
        got_ids, got = p_columns(r.output)
        same = got_ids == ids and got.keys() == ref.keys() and all(got[c] == ref[c] for c in ref)
        if not same or r.tokens != results[0].tokens:
            raise SystemExit(f"{LABELS[r.path]}: p_ columns or prompt tokens differ from {LABELS[results[0].path]}'s")
        print(f"{LABELS[r.path]}: p_ columns ({len(ref)}) bitwise those of {LABELS[results[0].path]}, "
              f"{len(ids)} ids", flush=True)
    times = f" x{args.scale}" if args.scale > 1 else ""
    print(f"\n{args.workload}{times} on one {args.device.upper()} device, {results[0].tokens:,} prompt tokens\n")
    print(table(results))


if __name__ == "__main__":
    main()
