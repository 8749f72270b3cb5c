"""Prompt assembly and the tokenizer fast path."""
from __future__ import annotations

from pathlib import Path

from policyscan.engine.policy import load_policy
from policyscan.engine.prompts import PromptBuilder, TextEncoder

SAMPLE = Path(__file__).resolve().parent.parent / "sample_data"


def test_prompt_is_bos_prefix_conversation_suffix_with_left_truncation():
    enc = TextEncoder(SAMPLE / "model")
    pol = load_policy(SAMPLE / "policies" / "pii")
    b = PromptBuilder.for_policy(enc, pol, max_length=64)
    conv = enc.encode("<|user|>hello there\\n")
    ids, cut = b.build(conv)
    assert ids == [enc.bos] + enc.encode(pol.prefix) + conv + enc.encode(pol.suffix) and not cut
    long = list(range(3, 503))
    ids, cut = b.build(long)
    assert cut and len(ids) == 64 and ids[-len(b.suffix) - 3:-len(b.suffix)] == long[-3:]
    assert b.head + b.tail(long) == ids


def test_gigatoken_is_checked_and_dropped_when_it_disagrees():
    enc = TextEncoder(SAMPLE / "model")
    assert enc.backend == "gigatoken"  # agreed on the probe texts
    texts = [f"conversation {i} with some text" for i in range(40)]
    good = enc.encode_batch(texts)

    class Wrong:
        def encode_batch_list(self, batch):
            return [[1] for _ in batch]

    enc.fast = Wrong()
    assert enc.encode_batch(texts) == good  # the spot check caught it and this call fell back
    assert enc.fast is None and enc.backend.startswith("tokenizers")
