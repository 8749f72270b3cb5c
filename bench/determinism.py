"""Where bits move: each GPU kernel and the engine, scored again and again, in one process and in several.

    python bench/determinism.py kernels          # each kernel REPS times, poisoned memory; rows vs sub-batches
    python bench/determinism.py e2e [--shape 1b] # the engine in 3 processes x precisions x budgets x graphs

`kernels` prints, per case, how many output elements differ between repeated calls on the same inputs (a race or
an uninitialized read) and between the whole batch and sub-batches of it (batch invariance). `e2e` scores
W3-like prompts (many policies, skewed per batch) in fresh processes and counts the f values that differ.
A diagnostic, not a test: tests/test_determinism.py holds the checks that gate a change.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import lengths, random_decoder, shape  # noqa: E402

from policyscan.engine.run.batch import pack, plan_batches  # noqa: E402
from policyscan.engine.run.graphs import GraphedForward  # noqa: E402
from policyscan.kernels import triton_ops  # noqa: E402

DEV = os.environ.get("BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: a dry run
REPS = 6


def poison_pool(nbytes: int = 2 << 30) -> None:
    """Fill free memory of the caching allocator with NaN bytes, so that a kernel reading memory nothing
    wrote sees NaN (and a different NaN-free run sees other bytes)."""
    if DEV == "cpu":
        return
    t = torch.empty(nbytes // 4, dtype=torch.float32, device=DEV)
    t.fill_(float("nan"))
    del t


def skewed_adapters(M: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """Token adapters sorted as a batch is: many adapters, Zipf-like popularity, a few rows of -1 first."""
    p = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
    ad = torch.multinomial(p / p.sum(), M, replacement=True, generator=gen) - 0
    ad[: M // 50] = -1
    return torch.sort(ad).values.to(torch.int32)


def compare(name: str, outs: list, subs: list | None = None) -> dict:
    """outs: REPS results of one call; subs: (row index tensor, result) pairs from sub-batches."""
    ref = [o if isinstance(o, tuple) else (o,) for o in outs]
    rep = sum(int((a.view(torch.uint8) != b.view(torch.uint8)).sum()) if a.dtype.itemsize == 1 else
              int((~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())
              for r in ref[1:] for a, b in zip(ref[0], r))
    nan = sum(int(torch.isnan(a.float()).sum()) for a in ref[0])
    sub = 0
    for rows, r in subs or []:
        r = r if isinstance(r, tuple) else (r,)
        for a, b in zip(ref[0][:1], r[:1]):
            sub += int((a[rows].float() != b.float()).sum())
    row = {"case": name, "repeat_diff": rep, "subbatch_diff": sub, "nan": nan}
    print(json.dumps(row), flush=True)
    return row


def kernels() -> list[dict]:
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed {seed}", flush=True)
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def rnd(*s, dtype=torch.bfloat16, scale=1.0):
        return (torch.randn(*s, generator=gen) * scale).to(DEV, dtype)

    def windows(M):
        return [(0, M // 3), (M // 5, M // 2 + 7), (M - M // 4, M)]

    for dtype, M, R, n, silu, res in [
        (torch.bfloat16, 300, 16, 64, False, True), (torch.bfloat16, 3000, 16, 64, False, True),
        (torch.bfloat16, 3000, 32, 64, True, False), (torch.bfloat16, 3000, 48, 256, False, False),
        (torch.float8_e4m3fn, 300, 16, 64, False, True), (torch.float8_e4m3fn, 1000, 32, 64, True, False),
        (torch.float8_e4m3fn, 3000, 16, 64, False, True), (torch.float8_e4m3fn, 3000, 32, 256, True, False),
        (torch.float8_e4m3fn, 6000, 48, 256, False, False),
    ]:
        N, K = 1536, 1024
        x = rnd(M, K, scale=0.5).to(dtype)
        W = rnd(N, K, scale=K ** -0.5).to(dtype)
        fp8 = dtype == torch.float8_e4m3fn
        xs = rnd(M, dtype=torch.float32).abs() + 0.1 if fp8 else None
        ws = rnd(N, dtype=torch.float32).abs() + 0.1 if fp8 else None
        s = rnd(M, R)
        B = rnd(n, N, R, scale=0.1)
        ad = skewed_adapters(M, n, gen).to(DEV)
        resid = rnd(M, N) if res else None

        def call(sl=slice(None)):
            poison_pool()
            return triton_ops.lora_gemm(x[sl], xs[sl] if fp8 else None, W, ws, s[sl], B, ad[sl], None,
                                        resid[sl] if res else None, torch.bfloat16, silu, row_amax=fp8 and not silu)

        outs = [call() for _ in range(REPS)]
        subs = [(torch.arange(a, b, device=DEV), call(slice(a, b))) for a, b in windows(M)]
        rows.append(compare(f"lora_gemm {str(dtype)[6:]} M={M} R={R} n={n} silu={silu} res={res}",
                            [o[0] if isinstance(o, tuple) else o for o in outs],
                            [(r, o[0] if isinstance(o, tuple) else o) for r, o in subs]))

    for quant, norm, M, R, n, tma in [
        (False, True, 3000, 48, 64, False), (False, False, 3000, 16, 64, False),
        (True, True, 3000, 48, 64, False), (True, True, 3000, 48, 256, True), (True, False, 3000, 16, 64, False),
        (True, True, 300, 32, 64, True),
    ]:
        K = 1024
        x = rnd(M, K)
        w = rnd(K).abs() + 0.5 if norm else None
        A = rnd(n, R, K, scale=K ** -0.5)
        ad = skewed_adapters(M, n, gen).to(DEV)
        amax = (x.float() * (w.float() if norm else 1)).abs().amax(1)[None].contiguous() if quant else None

        def call(sl=slice(None)):
            poison_pool()
            return triton_ops.prologue(x[sl], w, 1e-5, A, ad[sl], quant,
                                       x_amax=amax[:, sl].contiguous() if quant else None, tma=tma)

        outs = [call() for _ in range(REPS)]
        subs = [(torch.arange(a, b, device=DEV), call(slice(a, b))) for a, b in windows(M)]
        for i, part in enumerate(("h", "h_scale", "s")):
            if outs[0][i] is None:
                continue
            rows.append(compare(f"prologue quant={quant} norm={norm} M={M} R={R} n={n} tma={tma} [{part}]",
                                [o[i] for o in outs], [(r, o[i]) for r, o in subs]))

    from policyscan.kernels.reference import AttnShape
    for last in (False, True):
        lens = torch.from_numpy(lengths(40, seed % 1000)).int()
        cu = torch.zeros(41, dtype=torch.int32)
        cu[1:] = torch.cumsum(lens, 0)
        T = int(cu[-1])
        qkv = rnd(T, (24 + 16) * 128)
        outs = []
        for _ in range(REPS):
            poison_pool()
            outs.append(triton_ops.varlen_attention(qkv, cu.to(DEV), AttnShape(24, 8, 128), 128 ** -0.5,
                                                    last_only=last, row_amax=True)[0])
        rows.append(compare(f"attention last_only={last}", outs))

    # the final norm and head, as Decoder.forward ends: the same rows inside batches of other sizes
    H = 3072
    h = rnd(6000, H, scale=3.0)
    nw = rnd(H).abs() + 0.5
    head = rnd(64, H, dtype=torch.float32)
    ad = torch.randint(0, 64, (6000,), generator=gen).to(DEV, torch.int32)

    def final(sl):
        return triton_ops.head(h[sl], nw, 1e-5, head, ad[sl])

    ref = final(slice(0, 8))
    diff = sum(int((final(slice(0, b))[:8] != ref).sum()) for b in (1, 8, 9, 33, 130, 1000, 6000)[1:])
    row = {"case": "final norm + head, first 8 rows in batches of 8..6000", "repeat_diff": 0, "subbatch_diff": diff,
           "nan": 0}
    print(json.dumps(row), flush=True)
    rows.append(row)
    return rows


def worker(args) -> None:
    """One process: f for W3-like prompts at each (precision, budget, graphs), saved as .npy."""
    cfg = shape(args.shape)
    out = Path(args.dir)
    n_conv = args.conversations
    rng = np.random.default_rng(1)
    convs = [rng.integers(0, cfg.vocab, int(n)).tolist() for n in lengths(n_conv, 3)]
    for fp8 in (False, True):
        dec = random_decoder(cfg, args.adapters, 16, triton_ops, DEV, fp8=fp8, seed=5)
        seqs = [c for c in convs for _ in range(args.adapters)]
        ads = np.array([a for _ in convs for a in range(args.adapters)])
        for budget in (65536, 3000):
            for graphs in (True, False):
                forward = GraphedForward(dec, None) if graphs else (lambda b, d=dec: d.forward(b.to(DEV)))
                f = np.empty(len(seqs), dtype=np.float32)
                with torch.inference_mode():
                    pend = []
                    for plan in plan_batches(np.array([len(s) for s in seqs]), ads, budget):
                        pend.append((plan.items, forward(pack([seqs[i] for i in plan.items],
                                                              ads[plan.items].tolist()))))
                    for items, o in pend:
                        f[items] = o.float().cpu().numpy()
                np.save(out / f"{'fp8' if fp8 else 'bf16'}_{budget}_{int(graphs)}.npy", f)
        del dec
        torch.cuda.empty_cache()


def e2e(args) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dirs = []
        for p in range(args.processes):
            d = Path(tmp) / f"p{p}"
            d.mkdir()
            subprocess.run([sys.executable, __file__, "worker", "--dir", str(d), "--shape", args.shape,
                            "--adapters", str(args.adapters), "--conversations", str(args.conversations)],
                           check=True)
            dirs.append(d)
        for prec in ("bf16", "fp8"):
            base = np.load(dirs[0] / f"{prec}_65536_1.npy")
            spread = float(np.std(base))
            for name in sorted(x.name for x in dirs[0].glob(f"{prec}_*.npy")):
                for p, d in enumerate(dirs):
                    f = np.load(d / name)
                    diff = f != base
                    row = {"case": f"{prec} {name[len(prec) + 1:-4]} process {p} vs p0 65536 graphs",
                           "pairs": int(f.size), "differ": int(diff.sum()),
                           "max_abs": float(np.abs(f - base).max()), "f_std": spread,
                           "nan": int(np.isnan(f).sum())}
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    return rows


class Tracer:
    """The GPU kernel set, recording each call's output as per-row checksums of its bits (cheap to keep)."""

    def __init__(self):
        self.log: list[tuple[str, tuple, torch.Tensor]] = []

    def _rec(self, name, args, out):
        outs = out if isinstance(out, tuple) else (out,)
        for k, t in enumerate(outs):
            if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.numel():
                v = t.reshape(t.shape[0], -1)
                bits = v.view(torch.uint8).to(torch.int64) if v.element_size() == 1 else \
                    v.view(torch.int16 if v.element_size() == 2 else torch.int32).to(torch.int64)
                w = torch.arange(1, bits.shape[1] + 1, device=bits.device, dtype=torch.int64)
                self.log.append((f"{name}[{k}]", tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor)),
                                 (bits * w).sum(1)))
        return out

    def __getattr__(self, name):
        fn = getattr(triton_ops, name)

        def wrapped(*a, **kw):
            return self._rec(name, a, fn(*a, **kw))
        return wrapped


def trace(args) -> None:
    """First kernel call whose output rows differ between two forwards of the same batch (same process)."""
    cfg = shape(args.shape)
    rng = np.random.default_rng(1)
    convs = [rng.integers(0, cfg.vocab, int(n)).tolist() for n in lengths(args.conversations, 3)]
    seqs = [c for c in convs for _ in range(args.adapters)]
    ads = np.array([a for _ in convs for a in range(args.adapters)])
    for fp8 in (False, True):
        tr = Tracer()
        dec = random_decoder(cfg, args.adapters, 16, tr, DEV, fp8=fp8, seed=5)
        plan = next(iter(plan_batches(np.array([len(s) for s in seqs]), ads, 65536)))
        batch = pack([seqs[i] for i in plan.items], ads[plan.items].tolist()).to(DEV)
        runs = []
        for rep in range(4):
            tr.log = []
            poison_pool()
            with torch.inference_mode():
                f = dec.forward(batch)
            runs.append((list(tr.log), f.clone()))
        for rep in range(1, 4):
            la, fa = runs[0]
            lb, fb = runs[rep]
            first = next(((i, a[0], a[1], int((a[2] != b[2]).sum()), a[2].numel())
                          for i, (a, b) in enumerate(zip(la, lb)) if not torch.equal(a[2], b[2])), None)
            print(json.dumps({"fp8": fp8, "rep": rep, "tokens": int(batch.ids.numel()), "seqs": batch.num_seqs,
                              "f_differ": int((fa != fb).sum()), "first_op": first}), flush=True)
        del dec
        torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["kernels", "e2e", "worker", "trace"])
    ap.add_argument("--dir")
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--adapters", type=int, default=64)
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--processes", type=int, default=3)
    args = ap.parse_args()
    if args.mode in ("worker", "trace"):
        (worker if args.mode == "worker" else trace)(args)
        return
    rows = kernels() if args.mode == "kernels" else e2e(args)
    bad = [r for r in rows if r.get("repeat_diff") or r.get("subbatch_diff") or r.get("differ") or r.get("nan")]
    print(f"\n{len(rows)} cases, {len(bad)} with differing bits or NaN:")
    for r in bad:
        print(" ", json.dumps(r))


if __name__ == "__main__":
    main()
