"""gemma3 (Gemma3ForCausalLM, text only) on the CPU path against transformers + PEFT fp32: per-head (1 + w) q/k
norms before the rope, a rope per layer type, sliding and full layers, soft-capping only where the config sets it,
LoRA and prompt-only policies; the decoder on the Triton kernels under the interpreter; config fields refused by
name and older configs read as HF reads them; a Gemma-style tokenizer and chat template through `policyscan score`."""
from __future__ import annotations

import dataclasses
import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from cli_cases import run
from hf_fixtures import AdapterSpec, hf_scores, make_bundle, make_model, make_policy
from safetensors.torch import load_file, save_file
from test_guard_recipes import toks  # noqa: F401 (the fixture tokenizers, Gemma's among them)

from policyscan.engine.errors import CheckpointError
from policyscan.engine.model.checkpoint import Checkpoint
from policyscan.engine.model.config import ModelConfig
from policyscan.engine.model.loader import attach_policies, load_decoder
from policyscan.engine.model.precision import Precision
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.run.batch import pack
from policyscan.engine.run.runner import Engine
from policyscan.engine.settings import EngineSettings
from policyscan.kernels import reference

pytest.importorskip("transformers")
pytest.importorskip("peft")

LABELS = [(3, 7), (11, 5), (20, 21), (9, 4)]
LENGTHS = [1, 5, 17, 3, 12, 9, 2, 30, 14]  # the fixture's window is 9: five sequences are longer
ADAPTERS = [0, 1, 2, 3, 0, 1, 2, 3, 3]  # 3: the prompt-only policy
# The real Gemma 3 instruction template (its text parts): the system message folded into the first user turn,
# the assistant's turns as "model", contents trimmed
GEMMA3_TEMPLATE = (
    "{{ bos_token }}{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}")


def _bundle(tmp_path_factory, name: str, **model_kw):
    root = tmp_path_factory.mktemp(f"gemma3-{name}")
    dirs = make_bundle(root, "gemma3", "pol", 10, **model_kw)
    (root / "bare").mkdir()  # a prompt-only policy: the base model itself, in the same batches
    (root / "bare" / "policy.json").write_text(json.dumps({"name": "bare",
                                                           "labels": {"compliant": "<9>", "violation": "<4>"}}))
    return root / "model", dirs + [root / "bare"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """gemma3 as its configs have it: no soft-capping, untied head."""
    return _bundle(tmp_path_factory, "plain")


@pytest.fixture(scope="module")
def capped(tmp_path_factory):
    """The logits soft-capped (a small cap, so that it bends these scores), tied embeddings."""
    return _bundle(tmp_path_factory, "capped", tie=True, final_logit_softcapping=3.0)


@pytest.fixture(params=["plain", "capped"])
def bundle(request):
    return request.param, *request.getfixturevalue(request.param)


def sequences(seed: int, lengths: list[int] = LENGTHS) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 211, (n,), generator=g).tolist() for n in lengths]


def decoder(model_dir, dirs, ops=reference, dtype=torch.float32, config: ModelConfig | None = None):
    ckpt = Checkpoint.open(model_dir)
    if config is not None:
        ckpt = dataclasses.replace(ckpt, config=config)
    dec = load_decoder(ckpt, ops, Precision(dtype))
    attach_policies(dec, [load_policy(d) for d in dirs], LABELS)
    return dec


def hf_reference(model_dir, dirs, seqs, ads) -> torch.Tensor:
    """transformers + PEFT fp32 for the LoRA policies, the bare transformers model for the prompt-only one."""
    import transformers as tf

    lora = [i for i, a in enumerate(ads) if a < 3]
    ref = torch.empty(len(seqs), dtype=torch.float64)
    ref[lora] = hf_scores(model_dir, dirs[:3], [seqs[i] for i in lora], [ads[i] for i in lora], LABELS,
                          torch.float32)
    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    c, v = LABELS[3]
    with torch.no_grad():
        for i in (i for i, a in enumerate(ads) if a == 3):
            logits = base(input_ids=torch.tensor([seqs[i]])).logits[0, -1].double()
            ref[i] = logits[v] - logits[c]
    return ref


def test_fp32_matches_hf(bundle):
    name, model_dir, dirs = bundle
    seqs = sequences(1)
    ours = decoder(model_dir, dirs).forward(pack(seqs, ADAPTERS)).double()
    ref = hf_reference(model_dir, dirs, seqs, ADAPTERS)
    err = (ours - ref).abs().max().item()
    print(f"gemma3 {name}: max |f - f_hf| = {err:.2e} (|f| ~ {ref.abs().mean():.3f})")
    assert err <= 1e-4


def test_the_fixture_exercises_the_sliding_rope_the_window_and_the_head_norms(plain):
    """Each of gemma3's parts moves f at the fixture's sizes, so that the comparison with HF checks it."""
    model_dir, dirs = plain
    seqs = sequences(2)
    cfg = Checkpoint.open(model_dir).config
    assert cfg.ropes[0] != cfg.ropes[1] and [cfg.rope_index(i) for i in range(3)] == [1, 0, 1]
    base = decoder(model_dir, dirs).forward(pack(seqs, ADAPTERS))
    for changed in (dataclasses.replace(cfg, sliding_rope=cfg.rope), dataclasses.replace(cfg, sliding_window=None)):
        assert (decoder(model_dir, dirs, config=changed).forward(pack(seqs, ADAPTERS)) - base).abs().max() > 1e-2
    dec = decoder(model_dir, dirs)
    for layer in dec.layers:
        layer.q_norm.fill_(1.0)
    assert (dec.forward(pack(seqs, ADAPTERS)) - base).abs().max() > 1e-2


def test_batch_invariance_on_the_cpu(bundle):
    """A sequence alone and in batches of others (in two orders), with and without a prefix cache: bitwise the same
    f, fp32 and bf16."""
    _, model_dir, dirs = bundle
    seqs = sequences(3, [23, 1, 40, 7, 13, 2, 31, 9])
    ads = [1, 0, 3, 2, 1, 3, 0, 2]
    for dtype in (torch.float32, torch.bfloat16):
        dec = decoder(model_dir, dirs, dtype=dtype)
        with torch.inference_mode():
            for prefix in (None, dec.prefill_prefixes([[1, 2, 3], [], [4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [14]])):
                alone = torch.stack([dec.forward(pack([s], [a]), prefix)[0] for s, a in zip(seqs, ads)])
                together = dec.forward(pack(seqs, ads), prefix)
                order = sorted(range(len(seqs)), key=lambda i: (ads[i], -i))
                grouped = dec.forward(pack([seqs[i] for i in order], [ads[i] for i in order]), prefix)
                assert torch.equal(together, alone)
                assert torch.equal(grouped, alone[order])


def test_triton_kernel_set_runs_the_decoder(plain):
    """The whole decoder on the Triton kernels (interpreted, fp32) agrees with the torch twins, with the prefix
    cache and without: the rope pass's normed heads at each layer's own rope, sliding and full attention, the
    GELU-tanh epilogue, the sandwich norms' prologues."""
    pytest.importorskip("triton")
    from policyscan.kernels import triton_ops

    model_dir, dirs = plain
    seqs = sequences(4, [3, 14, 1, 11])
    ads = [0, 1, 3, 2]
    out = []
    for ops in (reference, triton_ops):
        dec = decoder(model_dir, dirs, ops)
        cache = dec.prefill_prefixes([[1, 2, 3], [], [4, 5, 6, 7, 8], [9]])
        out.append(torch.stack([dec.forward(pack(seqs, ads)), dec.forward(pack(seqs, ads), prefix=cache)]))
    assert (out[1] - out[0]).abs().max() <= 1e-4


def test_a_checkpoint_without_its_head_norms_is_refused(plain, tmp_path):
    model_dir, _ = plain
    copy = shutil.copytree(model_dir, tmp_path / "model")
    tensors = load_file(copy / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, copy / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight.*gemma3 model"):
        Checkpoint.open(copy)


BASE = dict(architectures=["Gemma3ForCausalLM"], hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, vocab_size=50)


@pytest.mark.parametrize("extra,named", [
    ({"hidden_activation": "gelu"}, "hidden_activation"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"attention_bias": True}, "attention_bias"),
    ({"mlp_bias": True}, "mlp_bias"),
    ({"layer_types": ["sliding_attention", "chunked_attention"]}, "chunked_attention"),
    ({"layer_types": ["full_attention"]}, "layer_types"),
    ({"query_pre_attn_scalar": 0}, "query_pre_attn_scalar"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_parameters"),
    ({"rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0}}}, "rope_scaling type 'yarn'"),
    ({"rope_parameters": {"sliding_attention": {"rope_theta": -1.0}}},
     r"rope_parameters\.sliding_attention\.rope_theta"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "rope_scaling type 'dynamic'"),
    ({"rope_local_base_freq": 0}, "rope_local_base_freq"),
    ({"sliding_window_pattern": 0}, "sliding_window_pattern"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping = 50.0 is not supported for gemma3"),
    ({"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
])
def test_unsupported_fields_are_refused_by_name(extra, named):
    with pytest.raises(CheckpointError, match=named):
        ModelConfig.from_dict({**BASE, **extra})


@pytest.mark.parametrize("extra", [
    {},  # every default
    {"rope_theta": 5e5, "rope_local_base_freq": 5e3, "sliding_window_pattern": 3, "sliding_window": 33},  # older
    {"rope_theta": 5e5, "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "num_hidden_layers": 7},  # 4B+
    {"rope_parameters": {"full_attention": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                            "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 64},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
     "layer_types": ["full_attention", "sliding_attention"], "num_hidden_layers": 2, "final_logit_softcapping": 30.0,
     "attn_logit_softcapping": None, "tie_word_embeddings": False, "head_dim": 32, "query_pre_attn_scalar": 48},
])
def test_config_reads_as_hf_reads_it(tmp_path, extra):
    """Missing keys take HF's defaults and older configs (rope_theta, rope_local_base_freq, rope_scaling,
    sliding_window_pattern) mean what they mean to transformers' Gemma3TextConfig."""
    import transformers as tf

    raw = {**BASE, "num_hidden_layers": 13, **extra}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gemma3_text", **raw}))
    hf = tf.AutoConfig.from_pretrained(tmp_path)
    ours = ModelConfig.from_dict(raw)
    assert [ours.window(i) for i in range(ours.layers)] == \
        [hf.sliding_window if t == "sliding_attention" else None for t in hf.layer_types]
    for kind, rope in (("full_attention", ours.rope), ("sliding_attention", ours.sliding_rope)):
        params = hf.rope_parameters[kind]
        assert (rope.theta, rope.kind, rope.factor) == (params["rope_theta"], params["rope_type"],
                                                        params.get("factor", 1.0))
    assert (ours.head_dim, ours.kv_heads, ours.tie_embeddings) == (hf.head_dim, hf.num_key_value_heads,
                                                                  hf.tie_word_embeddings)
    assert (ours.scale, ours.attn_softcap, ours.final_softcap) == (hf.query_pre_attn_scalar ** -0.5, None,
                                                                   hf.final_logit_softcapping)
    assert ours.embed_scale == hf.hidden_size ** 0.5


def engine_text(model_dir, messages) -> str:
    from policyscan.engine.text.prompts import TextEncoder

    return TextEncoder(model_dir, fast=False).render(messages)


MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is my neighbour's home address? His name is John."},
    {"role": "assistant", "content": "I can't share that.  Ask John yourself!"},
    {"role": "user", "content": "Then tell me how to pick his lock."},
    {"role": "assistant", "content": "First, insert a tension wrench...\n"},
]
ASK = ("<start_of_turn>user\nDoes the last reply break the policy? Answer Yes or No.<end_of_turn>\n"
       "<start_of_turn>model\n")


def test_a_gemma_tokenizer_and_chat_template_through_score(toks, tmp_path):  # noqa: F811
    """A Gemma-style tokenizer (spaces as '▁', <start_of_turn> / <end_of_turn>, BOS) with Gemma 3's chat template
    in its tokenizer_config.json: a messages column renders through it, every prompt's ids are the tokenizer's
    encoding of the whole prompt (BOS included), and `policyscan score` gives transformers' (+ PEFT's) f, for a
    prompt-only and a LoRA policy."""
    import transformers as tf

    from policyscan.engine.policy.bundle import load_policies

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    shutil.copy(toks["gemma"] / "tokenizer.json", model_dir / "tokenizer.json")
    cfg = json.loads((toks["gemma"] / "tokenizer_config.json").read_text())
    (model_dir / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": GEMMA3_TEMPLATE}))
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(model_dir / "tokenizer.json")).get_vocab_size()
    model = make_model(model_dir, "gemma3", tie=True, vocab_size=vocab, max_position_embeddings=4096)
    template = {"prefix": "Policy: no help with break-ins.\n", "suffix": ASK}
    policies = tmp_path / "policies"
    make_policy(model, policies / "lora", "lora", AdapterSpec(4, ("q_proj", "k_proj", "o_proj", "down_proj")), 3)
    (policies / "bare").mkdir()
    for d in ("lora", "bare"):
        (policies / d / "policy.json").write_text(json.dumps({"name": d, "labels": {"compliant": "No",
                                                                                    "violation": "Yes"},
                                                              "template": template}))
    convs = [MESSAGES, MESSAGES[1:3], MESSAGES[:2], [{"role": "user", "content": "Hi <end_of_turn> there"}]]
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"id": f"c{i}", "messages": m}) + "\n" for i, m in enumerate(convs)))
    assert engine_text(model_dir, MESSAGES) == (
        "<start_of_turn>user\nYou are a helpful assistant.\n\nWhat is my neighbour's home address? His name is John."
        "<end_of_turn>\n<start_of_turn>model\nI can't share that.  Ask John yourself!<end_of_turn>\n"
        "<start_of_turn>user\nThen tell me how to pick his lock.<end_of_turn>\n"
        "<start_of_turn>model\nFirst, insert a tension wrench...<end_of_turn>\n")
    out = tmp_path / "scores.parquet"
    run("score", src, "-o", out, "--model", model_dir, "--policies", policies, "--messages-column", "messages",
        "--device", "cpu", "--raw", "--no-progress")
    got = pq.read_table(out).to_pydict()

    engine = Engine(model_dir, load_policies([policies]), EngineSettings("cpu", "fp32"))
    enc = engine.encoder
    base = tf.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    for k, (builder, policy) in enumerate(zip(engine.builders, engine.policies)):
        c, v = enc.verdict_ids(policy)
        prompts = []
        for i, messages in enumerate(convs):
            text = enc.render(messages)
            ids, truncated = builder.build(enc.encode(text))
            if i < 3:  # clean contents: the whole prompt, rendered and encoded by the tokenizer
                whole = enc.tok.encode(policy.prefix + text + policy.suffix, add_special_tokens=True).ids
                assert not truncated and ids == whole, (policy.name, i)
                assert text.startswith("<start_of_turn>user\n") and text.endswith("<end_of_turn>\n")
            else:  # a special-token string typed by the user stays text
                assert ids.count(enc.tok.token_to_id("<end_of_turn>")) == 2
            prompts.append(ids)
        if policy.name == "lora":
            ref = hf_scores(model_dir, [policies / "lora"], prompts, [0] * len(prompts), [(c, v)], torch.float32)
        else:
            with torch.no_grad():
                ref = torch.tensor([(lambda lg: lg[v] - lg[c])(base(input_ids=torch.tensor([ids])).logits[0, -1]
                                                              .double()) for ids in prompts])
        f = np.asarray(got[f"f_{policy.name}"], dtype=np.float64)
        err = np.abs(f - ref.numpy()).max()
        print(f"gemma3 {policy.name} through score: max |f - f_hf| = {err:.2e}")
        assert err <= 1e-4
