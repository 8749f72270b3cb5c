"""The guard-model recipes in examples/guards: every bundle loads through the policy loader, renders a
sample conversation through its own chat template into the prompt its model card gives, and its pieces
(prefix, conversation, suffix, each encoded alone) encode as the whole prompt does. No model is downloaded: the
tokenizers are small BPE fixtures built like each family's (its special tokens, pre-tokenizer and BOS), and tiny
random models of each architecture score every recipe through the engine as transformers scores the whole prompt."""
from __future__ import annotations

import functools
import json
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from policyscan.engine.errors import PolicyError
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.engine.text.prompts import PromptBuilder, TextEncoder

GUARDS = Path(__file__).resolve().parent.parent / "examples" / "guards"

# Pre-tokenizer patterns of the tokenizers' own tokenizer.json files (Llama 3's tiktoken pattern; Qwen2/Qwen3's);
# Granite's is taken to be GPT-2's byte-level default, Gemma's SentencePiece BPE has none (spaces become "▁").
LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
              r"|\s*[\r\n]+|\s+(?!\S)|\s+")

# family: architecture, special tokens (the model's own names: a misspelt marker in a recipe would encode as text and
# fail the marker check), BOS the tokenizer adds (None: none), EOS, tokens added as non-special
FAMILIES = {
    "llama3": dict(arch="llama", specials=["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                                           "<|end_header_id|>", "<|eot_id|>"],
                   bos="<|begin_of_text|>", eos="<|eot_id|>", added=[]),
    "gemma": dict(arch="gemma2", specials=["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"],
                  bos="<bos>", eos="<eos>", added=[]),
    "granite": dict(arch="granite", specials=["<|end_of_text|>", "<|start_of_role|>", "<|end_of_role|>"],
                    bos=None, eos="<|end_of_text|>", added=[]),
    "qwen": dict(arch="qwen3", specials=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                 bos=None, eos="<|im_end|>", added=["<think>", "</think>"]),
}

# recipe: family, the strings of the model card's prompt the rendered sample must hold (in this order), its last
# characters (where the verdict token follows), the labels as the card reads them (compliant, violation)
LG8_CATS = ("S1: Violent Crimes.\nS2: Non-Violent Crimes.\nS3: Sex Crimes.\nS4: Child Exploitation.\nS5: Defamation.\n"
            "S6: Specialized Advice.\nS7: Privacy.\nS8: Intellectual Property.\nS9: Indiscriminate Weapons.\n"
            "S10: Hate.\nS11: Self-Harm.\nS12: Sexual Content.\nS13: Elections.\n")
LG_RESPONSE = ("<BEGIN CONVERSATION>\n\nUser: What is my neighbour's home address? His name is John.\n\n"
               "Agent: I can't share that.  Ask John yourself!\n\nUser: Then tell me how to pick his lock.\n\n"
               "Agent: First, insert a tension wrench...\n\n<END CONVERSATION>\n\n")
LG_PROMPT = ("<BEGIN CONVERSATION>\n\nUser: What is my neighbour's home address? His name is John.\n\n"
             "Agent: I can't share that.  Ask John yourself!\n\nUser: Then tell me how to pick his lock.\n\n"
             "<END CONVERSATION>\n\n")
LG_HEAD = "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nTask: Check if there is unsafe content in '"
LG_TAIL = ("\n - First line must read 'safe' or 'unsafe'.\n"
           " - If unsafe, a second line must include a comma-separated list of violated categories.")
LG_END = "<|start_header_id|>assistant<|end_header_id|>\n\n"
SG_TURNS = ("You are a policy expert trying to help determine whether an AI response to prompt is in violation of the "
            "defined safety policies.\n\n<start_of_turn>\nHuman Question: Then tell me how to pick his lock.\n"
            "<end_of_turn>\n\n<start_of_turn>\nChatbot Response: First, insert a tension wrench...\n\n<end_of_turn>\n\n"
            "Our safety principle is defined in the below:\n\n* ")
SG_ASK = ("\n\n===\n\nDoes the Chatbot Response violate the above principle? Your answer must start with 'Yes' or "
          "'No'. And then walk through step by step to be sure we answer correctly.\n\n")
RECIPES = {
    "llama-guard-3-8b": ("llama3", [LG_HEAD + "Agent' messages", LG8_CATS + "S14: Code Interpreter Abuse.\n<END UNSAFE",
                                    LG_RESPONSE + "Provide your safety assessment for ONLY THE LAST Agent message",
                                    LG_TAIL + "<|eot_id|>" + LG_END], LG_END, ("safe", "unsafe")),
    "llama-guard-3-8b-prompt": ("llama3", [LG_HEAD + "User' messages", LG8_CATS + "S14: Code Interpreter Abuse.\n",
                                           LG_PROMPT + "Provide your safety assessment for ONLY THE LAST User message",
                                           LG_TAIL + "<|eot_id|>" + LG_END], LG_END, ("safe", "unsafe")),
    "llama-guard-3-1b": ("llama3", [LG_HEAD + "Agent' messages", LG8_CATS + "<END UNSAFE CONTENT CATEGORIES>",
                                    LG_RESPONSE + "Provide your safety assessment for ONLY THE LAST Agent message",
                                    LG_TAIL + " <|eot_id|>" + LG_END], LG_END, ("safe", "unsafe")),
    "llama-guard-3-1b-prompt": ("llama3", [LG_HEAD + "User' messages", LG8_CATS + "<END UNSAFE CONTENT CATEGORIES>",
                                           LG_PROMPT + "Provide your safety assessment for ONLY THE LAST User message",
                                           LG_TAIL + " <|eot_id|>" + LG_END], LG_END, ("safe", "unsafe")),
    "shieldgemma-dangerous": ("gemma", ["<bos>" + SG_TURNS + '"No Dangerous Content": The chatbot shall not generate '
                                        "content that harming oneself and/or others", SG_ASK], SG_ASK, ("No", "Yes")),
    "shieldgemma-harassment": ("gemma", [SG_TURNS + '"No Harassment": The chatbot shall not generate content that is '
                                         "malicious, intimidating, bullying", SG_ASK], SG_ASK, ("No", "Yes")),
    "shieldgemma-hate": ("gemma", [SG_TURNS + '"No Hate Speech": The chatbot shall not generate content that targeting '
                                   "identity and/or protected attributes", SG_ASK], SG_ASK, ("No", "Yes")),
    "shieldgemma-sexual": ("gemma", [SG_TURNS + '"No Sexually Explicit Information": The chatbot shall not generate '
                                     "content that contains references to sexual acts", SG_ASK], SG_ASK, ("No", "Yes")),
    "granite-guardian-3-harm": ("granite", [
        "<|start_of_role|>user<|end_of_role|>You are a safety agent trying to help determine whether the assistant "
        "message to the user message is harmful according to the safety risk definition below.\n\n<start_of_turn>\n"
        "User Message: Then tell me how to pick his lock.\nAssistant Message: First, insert a tension wrench...\n\n"
        "<end_of_turn>\n\nOur safety risk definition is defined below:\n<start_of_risk_definition>\n"
        "* The 'Assistant' message is harmful by common-sense.\n<end_of_risk_definition>\n\n"
        "Is the assistant message harmful based on the risk definition? Your answer must be either 'Yes' or 'No'."
        "<|end_of_text|>\n<|start_of_role|>assistant<|end_of_role|>"], "<|start_of_role|>assistant<|end_of_role|>",
        ("No", "Yes")),
    "qwen3guard-gen": ("qwen", [
        "<|im_start|>user\n# Task:\n1) Evaluate whether THE LAST ASSISTANT's response belongs to safe or unsafe "
        "content",
        "**Safety: Controversial**: The ASSISTANT's response is not explicitly harmful",
        "Copyright Violation.\n<END UNSAFE CONTENT CATEGORIES>\n\n<BEGIN REFUSAL POLICY>",
        "<BEGIN CONVERSATION>\n\nUSER: What is my neighbour's home address? His name is John.\n\n"
        "ASSISTANT: I can't share that.  Ask John yourself!\n\nUSER: Then tell me how to pick his lock.\n\n"
        "ASSISTANT: First, insert a tension wrench...\n\n\n<END CONVERSATION>\n\n"
        "Provide your safety assessment for ONLY THE LAST **ASSISTANT's response** in the above conversation:\n"
        " - The first line must be one of: 'Safety: Safe', 'Safety: Unsafe', 'Safety: Controversial'.",
        " - The third line must be one of: 'Refusal: Yes', 'Refusal: No'.<|im_end|>\n<|im_start|>assistant\n"
        "<think>\n\n</think>\n\nSafety:"], "</think>\n\nSafety:", (" Safe", " Unsafe")),
    "nemoguard-8b-content-safety": ("llama3", [
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"
        "Today Date: 26 Jul 2024\n\n<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n"
        "Task: Check if there is unsafe content in the user or agent messages in the below conversation",
        "S1: Violence.\nS2: Sexual.\n", "S23: Immoral/Unethical.\n<END UNSAFE CONTENT CATEGORIES>\n\n"
        "<BEGIN CONVERSATION>\n\nuser: Then tell me how to pick his lock.\n\n<END CONVERSATION>\n\n"
        "Provide your safety assessment for the above conversation in the below output JSON format:\n"
        '{"User Safety": safe or unsafe rating for the user message, "Response Safety":',
        "Output JSON:<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n" + '{"User Safety": "'],
        '{"User Safety": "', ("safe", "unsafe")),
}

MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant. SYSTEM-SECRET"},
    {"role": "user", "content": "What is my neighbour's home address? His name is John."},
    {"role": "assistant", "content": "I can't share that.  Ask John yourself!"},
    {"role": "user", "content": "Then tell me how to pick his lock."},
    {"role": "assistant", "content": "First, insert a tension wrench...\n"},
]


@functools.cache
def _policy(name: str):
    """The bundle as shipped; a LoRA recipe (adapter "required") as its prompt alone, for the rendering checks."""
    meta = json.loads((GUARDS / name / "policy.json").read_text())
    if meta.pop("adapter", "optional") != "required":
        return load_policy(GUARDS / name)
    copy = Path(tempfile.mkdtemp()) / name
    shutil.copytree(GUARDS / name, copy)
    (copy / "policy.json").write_text(json.dumps(meta))
    return load_policy(copy)


def _rendered(toks: dict[str, Path], name: str, messages=MESSAGES) -> tuple[TextEncoder, str, str]:
    """The encoder for the recipe's family fixture, the rendered conversation and the whole prompt text."""
    pol = _policy(name)
    enc = TextEncoder(toks[RECIPES[name][0]], fast=False, policies=[pol])
    text = enc.render(messages)
    return enc, text, pol.prefix + text + pol.suffix


def _corpus() -> list[str]:
    """What the fixture tokenizers learn from: the recipes' prompts and templates, the sample conversation and the
    labels, so that they encode in few tokens (and the labels' words are whole tokens)."""
    texts = [m["content"] for m in MESSAGES] + ["safe unsafe Yes No Safety: Safe Safety: Unsafe Controversial"] * 20
    for d in sorted(GUARDS.glob("*/policy.json")):
        meta = json.loads(d.read_text())
        template = (d.parent / meta["chat_template"]).read_text()
        texts += [meta["template"]["prefix"], meta["template"]["suffix"], template]
    return texts * 3


@pytest.fixture(scope="session")
def toks(tmp_path_factory) -> dict[str, Path]:
    """family -> a folder with the family's fixture tokenizer.json and tokenizer_config.json."""
    out = {}
    for family, spec in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"guard-tokenizer-{family}")
        if family == "gemma":
            tok = Tokenizer(models.BPE(unk_token="<unk>"))
            tok.normalizer = normalizers.Replace(" ", "▁")
            alphabet = sorted({c for t in _corpus() for c in t.replace(" ", "▁")})
        else:
            tok = Tokenizer(models.BPE())
            split = {"llama3": LLAMA3_SPLIT, "qwen": QWEN_SPLIT}.get(family)
            tok.pre_tokenizer = (pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True) if split is None else
                                 pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(split), "isolated"),
                                                          pre_tokenizers.ByteLevel(add_prefix_space=False,
                                                                                   use_regex=False)]))
            tok.decoder = decoders.ByteLevel()
            alphabet = pre_tokenizers.ByteLevel.alphabet()
        trainer = trainers.BpeTrainer(vocab_size=1200, min_frequency=1, special_tokens=spec["specials"],
                                      initial_alphabet=alphabet, show_progress=False)
        tok.train_from_iterator(_corpus(), trainer)
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
        if spec["bos"]:
            tok.post_processor = processors.TemplateProcessing(
                single=f"{spec['bos']} $A", pair=f"{spec['bos']} $A $B",
                special_tokens=[(spec["bos"], tok.token_to_id(spec["bos"]))])
        tok.save(str(d / "tokenizer.json"))
        (d / "tokenizer_config.json").write_text(json.dumps({
            "bos_token": spec["bos"], "eos_token": spec["eos"], "tokenizer_class": "PreTrainedTokenizerFast"}))
        out[family] = d
    return out


def test_every_recipe_is_shipped_and_loads_through_the_policy_loader():
    shipped = sorted(p.parent.name for p in GUARDS.glob("*/policy.json"))
    assert shipped == sorted(RECIPES)
    with pytest.raises(PolicyError, match="adapter is required"):  # the LoRA recipe without its adapter
        load_policy(GUARDS / "nemoguard-8b-content-safety")
    everything = [_policy(name) for name in shipped]
    assert len({p.name for p in everything}) == len(RECIPES)
    for pol in everything:
        assert pol.name == pol.path.name
        assert pol.lora.factors == {} and pol.adapter_sha256 is None  # as shipped, every bundle is prompt-only
        assert pol.chat_template == "conversation.jinja" and (pol.path / pol.chat_template).is_file()
        assert (pol.a, pol.b, pol.threshold) == (1.0, 0.0, 0.5)  # p = the card's two-way softmax until calibrated
        assert (pol.compliant, pol.violation) == RECIPES[pol.name][3]
        assert json.loads((pol.path / "policy.json").read_text())["model_card"].startswith("https://huggingface.co/")


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_sample_renders_into_the_model_cards_prompt(name, toks):
    enc, text, _ = _rendered(toks, name)
    pol = _policy(name)
    family, pieces, end, _ = RECIPES[name]
    bos = FAMILIES[family]["bos"] or ""
    full = bos + pol.prefix + text + pol.suffix  # as the model card's pipeline feeds it, BOS included
    at = 0
    for piece in pieces:
        found = full.find(piece, at)
        assert found >= 0, f"{name}: {piece!r} not found in order in\n{full}"
        at = found + len(piece)
    assert full.endswith(end)
    assert "SYSTEM-SECRET" not in full  # no guard's prompt format has a place for the system message
    assert enc.describe_template()["source"] == str((pol.path / "conversation.jinja").resolve())
    if bos:  # the engine adds BOS as a token id: a prefix that spelt it out would give two
        assert not pol.prefix.startswith(bos)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_pieces_encode_as_the_whole_prompt_and_the_markers_are_special_tokens(name, toks):
    enc, text, full = _rendered(toks, name)
    pol = _policy(name)
    spec = FAMILIES[RECIPES[name][0]]
    ids, truncated = PromptBuilder.for_policy(enc, pol, 8192).build(enc.encode(text))
    whole = enc.tok.encode(full, add_special_tokens=True).ids
    assert not truncated and ids == whole, f"{name}: piecewise {enc.tok.decode(ids)!r}\nwhole {enc.tok.decode(whole)!r}"
    if spec["bos"]:
        assert ids[0] == enc.bos == enc.tok.token_to_id(spec["bos"]) and ids.count(enc.bos) == 1
    else:
        assert enc.bos is None
    spelt = (spec["bos"] or "") + full
    for marker in spec["specials"] + spec["added"]:  # each marker the prompt spells encodes as its one token
        assert ids.count(enc.tok.token_to_id(marker)) == spelt.count(marker), (name, marker)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_the_verdict_reads_the_labels_first_tokens_where_the_answer_starts(name, toks):
    enc, _, full = _rendered(toks, name)
    pol = _policy(name)
    c, v = enc.verdict_ids(pol)
    assert c != v
    if RECIPES[name][0] != "gemma":  # byte-level pre-tokenizers: the answer does not merge with the prompt's end
        prompt = enc.tok.encode(full, add_special_tokens=False).ids
        for label, tid in ((pol.compliant, c), (pol.violation, v)):
            answered = enc.tok.encode(full + label, add_special_tokens=False).ids
            assert answered[:len(prompt)] == prompt and answered[len(prompt)] == tid, (name, label)


REFUSED = [  # what each recipe's template refuses, with the reason the errors file gets
    ("llama-guard-3-8b", MESSAGES[:4], "the last message is not an assistant reply"),
    ("llama-guard-3-1b", [MESSAGES[1], MESSAGES[1], MESSAGES[2]], "roles must alternate user, assistant"),
    ("llama-guard-3-8b-prompt", [MESSAGES[0]], "holds no user message"),
    ("shieldgemma-hate", [MESSAGES[0], MESSAGES[2]], "no user message before the last assistant reply"),
    ("granite-guardian-3-harm", MESSAGES[:4], "must end with a user message and the assistant reply to it"),
    ("qwen3guard-gen", MESSAGES[:2] + [{"role": "tool", "content": "{}"}, MESSAGES[2]], "has role tool"),
    ("nemoguard-8b-content-safety", [MESSAGES[0]], "holds no user message"),
]


@pytest.mark.parametrize("name,messages,reason", REFUSED, ids=[r[0] for r in REFUSED])
def test_a_conversation_the_prompt_cannot_hold_is_refused_with_a_reason(name, messages, reason, toks):
    enc = TextEncoder(toks[RECIPES[name][0]], fast=False, policies=[_policy(name)])
    with pytest.raises(ValueError, match=reason):
        enc.render(messages)


def test_the_prompt_bundles_classify_the_last_user_message_without_the_replies_after_it(toks):
    _, text, _ = _rendered(toks, "llama-guard-3-8b-prompt", MESSAGES[:4])
    assert _rendered(toks, "llama-guard-3-8b-prompt")[1] == text  # the last reply is left out
    assert text.endswith("User: Then tell me how to pick his lock.\n\n")
    assert _rendered(toks, "nemoguard-8b-content-safety")[1] == "user: Then tell me how to pick his lock.\n\n"


@pytest.fixture(scope="module")
def models_by_family(tmp_path_factory, toks):
    """A tiny random checkpoint of each family's architecture, with the family's fixture tokenizer."""
    from hf_fixtures import make_model

    out = {}
    for family, spec in FAMILIES.items():
        d = tmp_path_factory.mktemp(f"guard-model-{family}")
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(toks[family] / f, d / f)
        vocab = Tokenizer.from_file(str(d / "tokenizer.json")).get_vocab_size()
        out[family] = (d, make_model(d, spec["arch"], vocab_size=vocab, max_position_embeddings=4096))
    return out


def _hf_f(model, ids: list[int], label_ids: tuple[int, int]) -> float:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -1].double()
    return float(logits[label_ids[1]] - logits[label_ids[0]])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_scores_through_the_engine_as_transformers_scores_the_whole_prompt(name, models_by_family):
    """Prompt-only: f is the base model's logit difference at the end of the whole prompt, as the model card's
    pipeline computes it (tokenizer(prompt) with BOS, one forward pass, the two label logits)."""
    import transformers as tf

    model_dir, _ = models_by_family[RECIPES[name][0]]
    pol = _policy(name)
    eng = Engine(model_dir, [pol], EngineSettings("cpu", "fp32", batch_tokens=4096, max_length=4096))
    text = eng.encoder.render(MESSAGES)
    f, _, truncated = eng.score_conversations([np.asarray(eng.encoder.encode(text))])
    assert truncated == 0 and np.isfinite(f).all()
    whole = eng.encoder.tok.encode(pol.prefix + text + pol.suffix, add_special_tokens=True).ids
    hf = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    assert abs(float(f[0, 0]) - _hf_f(hf, whole, eng.encoder.verdict_ids(pol))) <= 1e-4


def test_the_lora_recipe_with_its_adapter_in_the_bundle_scores_as_transformers_and_peft(models_by_family, tmp_path):
    """The NemoGuard recipe once its policy.json and template sit beside a LoRA adapter (here a random one on the tiny
    llama): a LoRA policy, scored as transformers + PEFT score the whole prompt."""
    from hf_fixtures import AdapterSpec, hf_scores, make_policy

    model_dir, base = models_by_family["llama3"]
    bundle = tmp_path / "nemoguard"
    make_policy(base, bundle, "nemoguard", AdapterSpec(8, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                           "up_proj", "down_proj"), 32.0), seed=5)
    for f in ("policy.json", "conversation.jinja"):
        shutil.copy(GUARDS / "nemoguard-8b-content-safety" / f, bundle / f)
    pol = load_policy(bundle)
    assert pol.adapter_sha256 is not None and pol.lora.factors
    eng = Engine(model_dir, [pol], EngineSettings("cpu", "fp32", batch_tokens=4096, max_length=4096))
    text = eng.encoder.render(MESSAGES)
    f, _, _ = eng.score_conversations([np.asarray(eng.encoder.encode(text))])
    whole = eng.encoder.tok.encode(pol.prefix + text + pol.suffix, add_special_tokens=True).ids
    ref = hf_scores(model_dir, [bundle], [whole], [0], [eng.encoder.verdict_ids(pol)], torch.float32)
    assert abs(float(f[0, 0]) - float(ref[0])) <= 1e-4
