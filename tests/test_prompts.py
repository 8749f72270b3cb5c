"""Prompt assembly and the tokenizer fast path."""
from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import time
from pathlib import Path

import pytest

from policyscan.engine.errors import CheckpointError
from policyscan.engine.inputs.sources import ReadSpec, read_chunks
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.text.prompts import PromptBuilder, TextEncoder

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"


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


def _model_with_template(tmp_path, template: str) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(SAMPLE / "model" / name, model / name)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return model


def test_chat_template_syntax_error_is_refused_when_the_tokenizer_loads(tmp_path):
    model = _model_with_template(tmp_path, "{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    with pytest.raises(CheckpointError, match=r"tokenizer_config.json: the chat template does not compile "
                                              r"\(line 2 of the template: .*\); fix chat_template"):
        TextEncoder(model)


def test_a_template_that_loops_without_end_costs_that_row_only(tmp_path):
    loop = "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}"
    model = _model_with_template(tmp_path, "{% for m in messages %}{% if m.content == 'loop' %}" + loop +
                                 "{% endif %}<|{{ m.role }}|>{{ m.content }}{% endfor %}")
    enc = TextEncoder(model)
    enc.render = dataclasses.replace(enc.render, template=dataclasses.replace(enc.chat_template, seconds=0.2))
    src = tmp_path / "m.jsonl"
    src.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": c}]}) for c in ("hi", "loop", "yo")))
    t0, tracer = time.monotonic(), sys.gettrace()
    chunk = next(read_chunks(src, ReadSpec(), enc.render))
    assert time.monotonic() - t0 < 5 and sys.gettrace() is tracer  # the time limit's tracer is gone
    assert chunk.texts == ["<|user|>hi", None, "<|user|>yo"]
    assert chunk.lines[1] == 2 and "rendering took over 0.2 s; does the chat template loop" in chunk.errors[1]
