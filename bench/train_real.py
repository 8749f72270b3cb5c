"""A policy trained on a real model and real text (docs/performance.md): SmolLM2-135M-Instruct (bench/smollm2.py
converts it) learns whether a paragraph of the Python standard library's documentation comes from a networking
module, through `policyscan train` in bf16 and with --precision fp8; each policy's holdout is scored through
score's engine in bf16 and in FP8: ROC AUC, and the share of verdicts that flip between the two at 0.5.

    python bench/train_real.py MODEL_DIR [--rows 1600] [--device cuda]"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from policyscan.calibration.metrics import roc_auc
from policyscan.engine.inputs.rows import ReadSpec
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.training.loop import LoopSettings
from policyscan.training.run import TrainJob, train_policy

NETWORK = ["socket", "ssl", "http.client", "http.server", "http.cookies", "urllib.request", "urllib.parse",
           "smtplib", "ftplib", "imaplib", "poplib", "email.message", "email.utils", "xmlrpc.client", "asyncio.streams",
           "socketserver", "ipaddress", "selectors", "wsgiref.simple_server", "mailbox"]
OTHER = ["os", "pathlib", "json", "collections", "itertools", "functools", "re", "string", "datetime", "decimal",
         "fractions", "statistics", "random", "csv", "sqlite3", "zipfile", "tarfile", "shutil", "logging", "argparse",
         "unittest", "textwrap", "difflib", "heapq", "bisect", "enum", "dataclasses", "typing", "inspect", "pickle",
         "tempfile", "glob", "fnmatch", "calendar", "configparser", "subprocess", "threading", "queue", "math"]
POLICY = {"name": "networking", "labels": {"compliant": " No", "violation": " Yes"},
          "template": {"prefix": "<|im_start|>user\nIs this documentation about computer networking?\n\n",
                       "suffix": "<|im_end|>\n<|im_start|>assistant\n"}, "threshold": 0.5}


def paragraphs() -> list[dict]:
    """Docstring paragraphs of 80-1200 characters, each labeled by its module's group, deduplicated."""
    rows, seen = [], set()
    for label, names in ((1, NETWORK), (0, OTHER)):
        for name in names:
            mod = importlib.import_module(name)
            for attr, obj in sorted(vars(mod).items()):
                if attr.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                    continue
                for para in (inspect.getdoc(obj) or "").split("\n\n"):
                    para = para.strip()
                    if 80 <= len(para) <= 1200 and para not in seen:
                        seen.add(para)
                        rows.append({"id": f"{name}.{attr}.{len(rows)}", "text": para, "label": label})
    return rows


def train(root: Path, model: Path, data: Path, precision: str, device: str) -> tuple[Path, dict, float]:
    folder = root / f"networking_{precision}"
    folder.mkdir()
    (folder / "policy.json").write_text(json.dumps(POLICY))
    job = TrainJob(model, folder, (data,), ReadSpec(text_column="text"), root / f"errors_{precision}.jsonl",
                   loop=LoopSettings(epochs=3, lr=5e-4, batch_tokens=16384), label_column="label", holdout=0.25,
                   device=device, precision=precision, max_length=512)
    t0 = time.perf_counter()
    result = train_policy(job, say=print)
    return folder, result.record, time.perf_counter() - t0


def scored(model: Path, folder: Path, data: Path, device: str) -> dict:
    """Holdout ROC AUC in bf16 and FP8 through score's engine, and the verdicts that flip between them."""
    from policyscan.engine.outputs.sinks import ErrorWriter
    from policyscan.engine.text.prompts import PolicyPrompts
    from policyscan.training.data import read_examples

    policy = load_policy(folder)
    prompts = PolicyPrompts.for_policies(model, [policy], 512)
    ex = read_examples(prompts, policy, [data], ReadSpec(text_column="text"), "label", 0.25,
                       ErrorWriter(folder.parent / "scored_errors.jsonl")).holdout
    y = np.array([e.label for e in ex], dtype=bool)
    a, b = policy.a, policy.b
    p = {}
    for precision in ("bf16", "fp8"):
        engine = Engine(model, [policy], EngineSettings(device, precision, max_length=512))
        f = engine.score([list(e.ids) for e in ex], [0] * len(ex)).astype(np.float64)
        p[precision] = 1 / (1 + np.exp(-(a * f + b)))
        del engine
    flips = float(((p["bf16"] >= 0.5) != (p["fp8"] >= 0.5)).mean())
    return {"rows": len(ex), "auc_bf16": roc_auc(p["bf16"], y), "auc_fp8": roc_auc(p["fp8"], y), "flips": flips}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", type=Path)
    ap.add_argument("--rows", type=int, default=1600)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    rows = paragraphs()
    rng = np.random.default_rng(0)
    rows = [rows[i] for i in sorted(rng.permutation(len(rows))[:args.rows])]
    root = Path(tempfile.mkdtemp(prefix="train_real_"))
    data = root / "labeled.parquet"
    pq.write_table(pa.Table.from_pylist(rows), data)
    print(f"{len(rows)} paragraphs, {sum(r['label'] for r in rows)} from networking modules", flush=True)
    table = []
    for precision in ("bf16", "fp8"):
        folder, rec, seconds = train(root, args.model, data, precision, args.device)
        s = scored(args.model, folder, data, args.device)
        table.append((precision, rec["untrained"]["holdout_roc_auc"], rec["epochs_run"], seconds,
                      rec["parity"]["max_abs_diff"], s))
    print("\n| trained in | untrained AUC | epochs | train s | parity max diff | holdout rows | AUC scored bf16 | "
          "AUC scored FP8 | verdicts flipping FP8 vs bf16 |\n|---|---|---|---|---|---|---|---|---|")
    for precision, auc0, epochs, seconds, diff, s in table:
        print(f"| {precision} | {auc0:.4f} | {epochs} | {seconds:.0f} | {diff:.3g} | {s['rows']} | {s['auc_bf16']:.4f} "
              f"| {s['auc_fp8']:.4f} | {s['flips']:.2%} |")


if __name__ == "__main__":
    main()
