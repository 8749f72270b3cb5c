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
    assert enc.encode_batch(texts) == good  # the check caught it and this call fell back
    assert enc.fast is None and enc.backend.startswith("tokenizers")
    assert "it had encoded 40 texts before, the first 40 checked in full" in enc.backend


def test_gigatoken_texts_are_checked_in_full_first_then_spot_checked():
    """A disagreement on one text of the first calls is caught wherever it is; later, spot checks only."""
    enc = TextEncoder(SAMPLE / "model")
    real = enc.fast
    texts = [f"conversation {i} with some text" for i in range(40)]

    class OneWrong:  # disagrees on one text (`bad`), by default one no spot check samples
        bad = 1

        def encode_batch_list(self, batch):
            ids = real.encode_batch_list(batch)
            ids[self.bad] = [1]
            return ids

    enc.fast = OneWrong()
    assert enc.encode_batch(texts, full_checks=40)[1] != [1] and enc.fast is None
    enc = TextEncoder(SAMPLE / "model")
    real = enc.fast
    enc.encode_batch(texts, full_checks=40)  # the full-check budget is spent on good texts
    enc.fast = OneWrong()
    # past it, only every 5th text is compared: a wrong text between them is not seen (what full checks are for)
    assert enc.encode_batch(texts, full_checks=40)[1] == [1]
    assert enc.fast is not None and enc.fast_texts == 80
    # a call straddling the budget: its first 3 texts are checked in full, then every 4th of the rest from 3 on
    for bad, caught in ((2, True), (3, True), (5, False)):
        enc = TextEncoder(SAMPLE / "model")
        real = enc.fast
        enc.fast = OneWrong()
        enc.fast.bad = bad
        assert (enc.encode_batch(texts, full_checks=3)[bad] != [1]) == caught and (enc.fast is None) == caught
