"""The attention kernel's tiles compiled for the H100/H200 (sm_90a) on any machine, no GPU needed: registers a thread,
spilled bytes, shared memory, programs an SM, and, read off the machine code of the loop over key blocks that needs no
mask (where long sequences spend their time), what one key block costs: its matrix instructions (wgmma shape, A from
shared memory, SS, or registers, RS), the bytes it reads from and writes to shared memory, the exponentials, and all
instructions.

    python bench/attention_ptx.py                  # the shipped tile and the tiles bench/gemm_table.py --sweep times
    python bench/attention_ptx.py --groups 4       # W5's group only (W1's is 3)

An SM's tensor cores do about 4096 bf16 FLOP a clock and its shared memory moves 128 bytes, so a tile that moves more
than 1 byte of shared memory for every 32 FLOP waits on it before the products do. Times and bits need the GPU:
bench/gemm_table.py --sweep."""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile
from collections import Counter

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas
from triton.compiler import ASTSource

from policyscan.kernels import attention
from policyscan.kernels.tuning import attention_long_tile, attention_tiles

KERNEL = attention._attn_kernel  # the kernel varlen_attention launches, compiled here without a launch
SCALARS = {"scale": "fp32", "window": "i32", "B": "i32", "stride_t": "i32", "stride_ot": "i32", "stride_pre": "i32",
           "K_COL": "i32", "V_COL": "i32", "stride_am": "i32", "cap": "fp32"}
ALIGNED = ("qkv_ptr", "o_ptr", "stride_t", "stride_ot", "K_COL", "V_COL")  # as Triton specializes W1's and W5's
REGISTERS, SHARED = 65536, 232448  # an SM's registers, and the shared memory a program may take (H100, H200)
D = 128
SWEPT = [(64, 4, 64, 2, None), (64, 4, 64, 3, 168), (128, 8, 32, 2, None), (128, 8, 64, 2, None),
         (128, 8, 64, 3, None), (128, 8, 128, 2, None), (64, 4, 128, 2, None)]  # gemm_table's --sweep


def compile_tile(G: int, cfg: dict) -> tuple[str, str, int]:
    """The full (not last-only) bf16 kernel without a prefix at this tile: (ptxas' report, the SASS, the shared
    memory a program takes)."""
    BQ = cfg["BQ"]
    const = dict(D=D, LAST_ONLY=False, HAS_PREFIX=False, AMAX=False, G=G, BQ=BQ, QP=triton.next_power_of_2(BQ),
                 BR=max(16, triton.next_power_of_2(BQ * G)), BN=cfg["BN"], BD=D, PREC="tf32", SOFTCAP=False, LIB=True)
    names = KERNEL.arg_names
    pointer = {"qkv_ptr": "*bf16", "o_ptr": "*bf16", "pre_ptr": "*bf16", "amax_ptr": "*fp32"}
    sig = {n: "constexpr" if n in const else SCALARS.get(n, pointer.get(n, "*i32")) for n in names}
    src = ASTSource(fn=KERNEL, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(names.index(k),): [["tt.divisibility", 16]] for k in ALIGNED})
    opts = dict(num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    if cfg.get("maxnreg"):
        opts["maxnreg"] = cfg["maxnreg"]
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
    ptx = compiled.asm["ptx"]
    ptxas = get_ptxas(90).path  # the ptxas Triton itself assembles sm_90a with
    with tempfile.TemporaryDirectory() as d:
        with open(os.path.join(d, "k.ptx"), "w") as f:
            f.write(ptx)
        cap = [f"--maxrregcount={cfg['maxnreg']}"] if cfg.get("maxnreg") else []
        report = subprocess.run([ptxas, *cap, "-v", "--gpu-name=sm_90a", f.name, "-o", os.path.join(d, "k.cubin")],
                                capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([os.path.join(os.path.dirname(ptxas), "cuobjdump"), "-sass", os.path.join(d, "k.cubin")],
                              capture_output=True, text=True, check=True).stdout
    return report, sass, compiled.metadata.shared


def first_loop(sass: str) -> list[str]:
    """The instructions of the first loop (the first backward branch): the key blocks that need no mask."""
    code = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    for at, ins in code:
        if (t := re.search(r"\bBRA\b.*?0x([0-9a-f]+)", ins)) and int(t.group(1), 16) < at:
            return [i for a, i in code if int(t.group(1), 16) <= a <= at]
    raise ValueError("no loop in the kernel's machine code")


def key_block(loop: list[str], warps: int) -> dict:
    """What one trip through the loop costs a program: FLOPs, shared-memory bytes read and written (wgmma operands
    read once a warpgroup; ldmatrix, ld.shared, st.shared and cp.async counted per warp), exponentials."""
    groups = warps // 4
    flops = read = written = 0
    forms: Counter = Counter()
    width = {"": 4, "64": 8, "128": 16, "U16": 2, "U8": 1}
    for ins in loop:
        op = re.sub(r"^@!?U?P\w+\s+", "", ins.strip())
        if m := re.match(r"HGMMA\.64x(\d+)x16\.F32\.BF16\s+R\d+,\s*(\S+)", op):
            n, a_regs = int(m.group(1)), m.group(2).startswith("R")
            forms[f"m64n{n}k16 {'RS' if a_regs else 'SS'}"] += 1
            flops += 2 * 64 * n * 16 * groups
            read += (n * 16 * 2 + (0 if a_regs else 64 * 16 * 2)) * groups
        elif m := re.match(r"LDSM\.16\.M(?:T)?88(?:\.(\d))?", op):
            read += 128 * int(m.group(1) or 1) * warps
        elif m := re.match(r"LDS(?:\.(64|128|U16|U8))?\b", op):
            read += 32 * width[m.group(1) or ""] * warps
        elif m := re.match(r"STS(?:\.(64|128|U16|U8))?\b", op):
            written += 32 * width[m.group(1) or ""] * warps
        elif m := re.match(r"LDGSTS\.\S*?(\d+)\s", op + " "):
            written += 32 * int(m.group(1)) // 8 * warps
    mufu = sum(1 for i in loop if "MUFU.EX2" in i)
    return dict(flops=flops, read=read, written=written, forms=forms, ex2=mufu, instructions=len(loop))


def _tile(cfg: dict) -> tuple:
    return cfg["BQ"], cfg["BN"], cfg["num_warps"], cfg["num_stages"], cfg.get("maxnreg")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", default="3,4", help="query heads a key/value head: W1 3, W5 4")
    args = ap.parse_args()
    print(f"{'G':>2} {'rows':>4} {'BN':>3} {'warps':>5} {'stages':>6} {'maxnreg':>7} {'regs':>4} {'spill':>5} "
          f"{'per SM':>6} {'read KB':>7} {'written KB':>10} {'FLOP/byte':>9} {'ex2':>4} {'instr':>5}  wgmma a key block")
    for G in (int(g) for g in args.groups.split(",")):
        long = attention_long_tile(G, D, False)
        shipped = [attention_tiles(G, D, False)] + ([long[1]] if long else [])
        swept = [dict(BQ=max(1, r // G), BN=bn, num_warps=w, num_stages=s, maxnreg=mr)
                 for r, w, bn, s, mr in SWEPT]
        seen = {_tile(t) for t in shipped}
        for cfg in shipped + [c for c in swept if _tile(c) not in seen]:
            report, sass, smem = compile_tile(G, cfg)
            regs = int(re.search(r"Used (\d+) registers", report).group(1))
            spill = int(re.search(r"(\d+) bytes spill stores", report).group(1))
            threads = 32 * cfg["num_warps"]
            per_sm = min(REGISTERS // (threads * ((regs + 7) // 8 * 8)), SHARED // max(smem, 1),
                         64 // cfg["num_warps"])
            kb = key_block(first_loop(sass), cfg["num_warps"])
            forms = ", ".join(f"{k} x{n}" for k, n in sorted(kb["forms"].items()))
            print(f"{G:>2} {cfg['BQ'] * G:>4} {cfg['BN']:>3} {cfg['num_warps']:>5} {cfg['num_stages']:>6} "
                  f"{cfg.get('maxnreg') or '-':>7} {regs:>4} {spill:>5} {per_sm:>6} {kb['read'] / 1024:>7.0f} "
                  f"{kb['written'] / 1024:>10.0f} {kb['flops'] / (kb['read'] + kb['written']):>9.1f} {kb['ex2']:>4} "
                  f"{kb['instructions']:>5}  {forms}" + ("  (shipped)" if any(cfg is t for t in shipped) else ""))


if __name__ == "__main__":
    main()
