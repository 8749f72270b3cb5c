"""Write a large JSONL input for the memory measurement: rows of ~50 KB of conversation text.

    python bench/make_big_input.py OUT.jsonl SIZE_MB"""
import json
import random
import sys

out, size_mb = sys.argv[1], int(sys.argv[2])
r = random.Random(0)
words = ["account", "phone", "invest", "savings", "address", "booking", "refund", "password", "stock", "help"]
written, i = 0, 0
with open(out, "w") as f:
    while written < size_mb << 20:
        text = " ".join(r.choice(words) for _ in range(7000))
        line = json.dumps({"id": f"big-{i}", "text": f"user: {text}\nassistant: I can help with that."}) + "\n"
        f.write(line)
        written += len(line)
        i += 1
print(f"{out}: {i} rows, {written / 2**20:.0f} MB")
