"""The text path's cost a conversation on the CPU: rendering messages through a chat template (content marked and
followed, engine/text/content.py and follow.py) against encoding the rendered text, and against the template's
plain render (no marks, nothing followed), on the sample tokenizer.

    python bench/render.py [--conversations N] [--repeats N]

Templates: a Llama-3-style one (content trimmed between header and end-of-turn tokens) and a Qwen-style one with a
tool call through tojson and reasoning. Conversations: two to six turns of the sample's messages, seeded. Prints the
median over repeats of microseconds a conversation for each."""
from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import pyarrow.parquet as pq  # noqa: E402

from policyscan.engine.text.prompts import TextEncoder  # noqa: E402

SAMPLE = ROOT / "policyscan" / "sample_data"
TEMPLATES = {
    "llama3-style": "{% for m in messages %}<|start|>{{ m.role }}<|end|>\n\n{{ m.content | trim }}<|eos|>{% endfor %}",
    "qwen-style tools": "{% for m in messages %}<|start|>{{ m.role }}\n{% if m.reasoning_content %}<think>"
                        "{{ m.reasoning_content.strip() }}</think>\n{% endif %}{{ m.content }}{% if m.tool_calls %}"
                        "{% for t in m.tool_calls %}\n<tool_call>{{ t.function | tojson }}</tool_call>{% endfor %}"
                        "{% endif %}<|eos|>\n{% endfor %}",
}


def conversations(n: int) -> list[list[dict]]:
    rows = pq.read_table(SAMPLE / "conversations.parquet").to_pylist()
    rng = random.Random(0)
    out = []
    for _ in range(n):
        msgs = [dict(m) for m in rng.choice(rows)["messages"]][: rng.randint(2, 6)]
        msgs[-1] = {**msgs[-1], "reasoning": "first, read it", "tool_calls": [
            {"function": {"name": "lookup", "arguments": {"q": msgs[0]["content"][:40], "n": 3}}}]}
        out.append(msgs)
    return out


def timed(fn, items, repeats: int) -> float:
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for x in items:
            fn(x)
        runs.append((time.perf_counter() - t0) / len(items) * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--conversations", type=int, default=2000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    convs = conversations(args.conversations)
    cfg = json.loads((SAMPLE / "model" / "tokenizer_config.json").read_text())
    print(f"{'template':<18} {'render us':>9} {'plain render us':>15} {'encode us':>9}")
    with tempfile.TemporaryDirectory() as tmp:
        for name, template in TEMPLATES.items():
            model = Path(tmp) / name.replace(" ", "_")
            model.mkdir()
            shutil.copy(SAMPLE / "model" / "tokenizer.json", model / "tokenizer.json")
            (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
            enc = TextEncoder(model)
            texts = [enc.render(c) for c in convs]
            render = timed(enc.render, convs, args.repeats)
            plain = timed(enc.chat_template.render, convs, args.repeats)
            encode = timed(enc.encode, texts, args.repeats)
            print(f"{name:<18} {render:>9.0f} {plain:>15.0f} {encode:>9.0f}")


if __name__ == "__main__":
    main()
