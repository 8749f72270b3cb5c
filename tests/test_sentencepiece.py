"""SentencePiece-style tokenizers (Llama 2, Mistral) put a '▁' before the start of whatever they encode: right for
a prompt's first piece, wrong for the conversation, the suffix and the labels that follow it. policyscan encodes
those as they follow a newline (or a special token), so its prompt is the whole prompt's tokenization, multi-turn
conversations with special tokens in them included."""
import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from policyscan.engine.errors import PolicyError
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.text.prompts import PromptBuilder, TextEncoder

CORPUS = ["user: my SSN is 123-45-6789.\nassistant: I can't store that.", "Question: is it safe?\nConversation:\n",
          "Answer: Yes", "Answer: No", "user: hello there\nassistant: hi, how can I help?", " Yes No yes no"] * 20
CONVERSATION = "user: hello there, my SSN is 123.\nassistant: I can't help with that."


def sentencepiece_tokenizer(root: Path, style: str) -> Path:
    """A small BPE with byte fallback, laid out as transformers converts Llama 2 tokenizers: `legacy` (a Prepend
    normalizer: '▁' after every special token too), `metaspace` (prepend_scheme first) or `always`; `t5` splits
    at whitespace first, so every word has its '▁' and pieces need nothing."""
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    # trained split at '▁' as SentencePiece is (no piece spans a space), then laid out as the conversion writes it
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=True)
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", "<s>", "</s>"]))
    spec = json.loads(tok.to_str())  # the byte-fallback pieces as plain vocabulary, as Llama 2's are
    vocab = spec["model"]["vocab"]
    vocab.update({f"<0x{i:02X}>": len(vocab) + i for i in range(256)})
    tok = Tokenizer.from_str(json.dumps(spec))
    if style == "legacy":
        tok.pre_tokenizer = None
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    elif style == "t5":
        tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="always", split=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first" if style == "metaspace"
                                                     else "always", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    d = root / style
    d.mkdir()
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    return d


def _policy(root: Path, prefix: str) -> Path:
    d = root / f"policy{len(prefix)}"
    d.mkdir()
    (d / "policy.json").write_text(json.dumps({
        "name": "q", "labels": {"compliant": " No", "violation": " Yes"},
        "template": {"prefix": prefix, "suffix": "\nAnswer:"}}))
    return d


MULTI_TURN = "[INST] hello there [/INST] hi, how can I help? </s><s>[INST] my SSN is 123 [/INST]"


@pytest.mark.parametrize("style", ["legacy", "metaspace", "always", "t5"])
@pytest.mark.parametrize("conversation", [CONVERSATION, MULTI_TURN, MULTI_TURN + " I can't help.</s>"])
def test_the_prompt_is_the_whole_prompts_tokenization(tmp_path, style, conversation):
    model = sentencepiece_tokenizer(tmp_path, style)
    whole = Tokenizer.from_file(str(model / "tokenizer.json"))
    assert whole.encode("a", add_special_tokens=False).tokens[0].startswith("▁")  # it does prepend
    enc = TextEncoder(model, chat_template="plain")
    assert enc.apart == (style == "t5") and ("follows other text" in enc.backend) != enc.apart
    pol = load_policy(_policy(tmp_path, "Question: is it safe?\nConversation:\n"))
    ids, _ = PromptBuilder.for_policy(enc, pol, 512).build(enc.encode(conversation))
    text = pol.prefix + conversation + pol.suffix
    assert ids == whole.encode(text, add_special_tokens=True).ids
    # a label is read as the model writes it after the prompt: '▁Yes', not '▁' + '▁Yes' (its own prepended start)
    c, v = enc.verdict_ids(pol)
    for label, want in ((" No", c), (" Yes", v)):  # the token the whole prompt's tokenization puts after it
        answered = whole.encode(text + label, add_special_tokens=True).ids
        assert answered[:len(ids)] == ids and answered[len(ids)] == want, label
    assert enc.label_tokens(" Yes") == ["▁Yes"]
    if style == "legacy":  # its Prepend normalizer, on the label alone, reads one '▁' too many
        assert whole.encode(" Yes", add_special_tokens=False).tokens != ["▁Yes"]


@pytest.mark.parametrize("prefix, why", [("", "is empty"), ("Question: is it safe?</s>", "ends in a special token")])
def test_a_prefix_the_conversation_cannot_follow_as_after_a_newline_is_refused(tmp_path, prefix, why):
    enc = TextEncoder(sentencepiece_tokenizer(tmp_path, "legacy"), chat_template="plain")
    with pytest.raises(PolicyError, match=rf"policy 'q' .*'▁' before a text's start.*prefix {why}\. End the prefix"):
        PromptBuilder.for_policy(enc, load_policy(_policy(tmp_path, prefix)), 512)
