"""The attention kernel's tiles compiled for the H100/H200 (sm_90a) on any machine, no GPU needed: for each tile the
matrix instructions ptxas gets (wgmma shape, and whether A comes from registers, RS, or shared memory, SS), registers
a thread, spilled bytes, shared memory, programs an SM, and the shared-memory bytes each key block reads and writes.

    python bench/attention_ptx.py                  # the shipped tile and the q_regs variants, W1's and W5's heads
    python bench/attention_ptx.py --groups 4       # W5's group only

It reads what costs no device time (docs/performance.md, "Tried and not kept" and "Not measured yet"): Triton stages a
dot operand that comes straight from a load in shared memory, so at the shipped tile q k^T reads q there again for
every key block; tuning.attention_tiles' q_regs passes q through a select, and the product reads it from registers.
Timings and bits need the GPU: bench/gemm_table.py --sweep."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from policyscan.kernels import attention
from policyscan.kernels.tuning import attention_tiles

KERNEL = attention._attn_kernel  # the kernel varlen_attention launches, compiled here without a launch
SCALARS = {"scale": "fp32", "window": "i32", "B": "i32", "stride_t": "i32", "stride_ot": "i32", "stride_pre": "i32",
           "K_COL": "i32", "V_COL": "i32", "stride_am": "i32", "cap": "fp32"}
ALIGNED = ("qkv_ptr", "o_ptr", "stride_t", "stride_ot", "K_COL", "V_COL")  # as Triton specializes W1's and W5's
REGISTERS, SHARED = 65536, 232448  # an SM's registers and shared memory a program may take (H100, H200)
D = 128


def tiles(G: int) -> list[dict]:
    """The shipped tile, then q_regs at the shipped tile and at the larger tiles the sweep times."""
    shipped = attention_tiles(G, D, False)
    q = dict(q_regs=True, maxnreg=None)
    return [shipped, {**shipped, **q, "maxnreg": 168}, {**shipped, **q, "BN": 64},
            {**shipped, **q, "BQ": 128 // G, "num_warps": 8}, {**shipped, **q, "BQ": 128 // G, "BN": 64, "num_warps": 8}]


def compile_tile(G: int, cfg: dict) -> dict:
    """Compile one tile of the full (not last-only) bf16 kernel, no prefix, and read ptxas' report."""
    BQ = cfg["BQ"]
    const = dict(D=D, LAST_ONLY=False, HAS_PREFIX=False, AMAX=False, G=G, BQ=BQ, QP=triton.next_power_of_2(BQ),
                 BR=max(16, triton.next_power_of_2(BQ * G)), BN=cfg["BN"], BD=D, PREC="tf32", SOFTCAP=False, LIB=True,
                 Q_REGS=cfg["q_regs"])
    names = KERNEL.arg_names
    sig = {n: ("constexpr" if n in const else SCALARS.get(n, "*fp32" if n == "amax_ptr" else
                                                          "*bf16" if n.endswith(("qkv_ptr", "o_ptr", "pre_ptr"))
                                                          else "*i32")) for n in names}
    src = ASTSource(fn=KERNEL, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx, smem = compiled.asm["ptx"], compiled.metadata.shared
    forms: dict[str, int] = {}
    for shape, a in re.findall(r"wgmma\.mma_async\.sync\.aligned\.(m\d+n\d+k\d+)\S*\s+\{[^}]*\},\s*(\{|%rd)", ptx):
        key = f"{shape} {'RS' if a == '{' else 'SS'}"
        forms[key] = forms.get(key, 0) + 1
    ptxas = get_ptxas(90).path  # the ptxas Triton itself assembles sm_90a with
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        cap = [f"--maxrregcount={cfg['maxnreg']}"] if cfg.get("maxnreg") else []
        report = subprocess.run([ptxas, *cap, "-v", "--gpu-name=sm_90a", f.name, "-o", os.devnull],
                                capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", report).group(1))
    spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
    threads = 32 * cfg["num_warps"]
    per_sm = min(REGISTERS // (threads * ((regs + 7) // 8 * 8)), SHARED // max(smem, 1), 64 // cfg["num_warps"])
    # a key block: k and v written by cp.async once a program; k and v read by each warpgroup's products, and q too
    # where q k^T's A operand sits in shared memory
    groups = cfg["num_warps"] // 4
    q_bytes = 0 if any(k.endswith("RS") and k.startswith("m64n" + str(cfg["BN"])) for k in forms) else 64 * D * 2
    kv = cfg["BN"] * D * 2
    moved = 2 * kv + groups * (2 * kv + q_bytes)
    flops = 4 * 64 * groups * cfg["BN"] * D
    return dict(regs=regs, spill=spill, smem=smem, per_sm=per_sm, forms=forms, bytes_per_flop=moved / flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="3,4", help="query heads a key/value head: W1 3, W5 4")
    args = ap.parse_args()
    print(f"{'G':>2} {'rows':>4} {'BN':>3} {'warps':>5} {'maxnreg':>7} {'q_regs':>6} {'regs':>4} {'spill':>5} "
          f"{'smem KB':>7} {'per SM':>6} {'smem B/FLOP':>11}  wgmma")
    for G in (int(g) for g in args.groups.split(",")):
        for cfg in tiles(G):
            r = compile_tile(G, cfg)
            forms = ", ".join(f"{k} x{n}" for k, n in sorted(r["forms"].items()))
            print(f"{G:>2} {cfg['BQ'] * G:>4} {cfg['BN']:>3} {cfg['num_warps']:>5} {cfg.get('maxnreg') or '-':>7} "
                  f"{str(cfg['q_regs']):>6} {r['regs']:>4} {r['spill']:>5} {r['smem'] / 1024:>7.0f} {r['per_sm']:>6} "
                  f"{'1/%.0f' % (1 / r['bytes_per_flop']):>11}  {forms}")
    print("\nAn SM's tensor cores do about 4096 bf16 FLOP a clock and its shared memory moves 128 bytes: a tile above "
          "1/32 byte a FLOP waits on shared memory before the products.")


if __name__ == "__main__":
    main()
