"""Chat templates (engine/text/chat_template.py): where a model's templates are read, --chat-template, a policy's
chat_template, and no silent fallback: a messages column with no template is a usage error that names
--chat-template plain."""
import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from policyscan.cli.main import cli
from policyscan.engine.outputs.sinks import read_metadata
from policyscan.engine.policy.bundle import load_policy
from policyscan.engine.text.chat_template import TemplateChoiceError, choose_template, model_templates
from policyscan.engine.text.prompts import TextEncoder

SAMPLE = Path(__file__).resolve().parent.parent / "policyscan" / "sample_data"
MESSAGES = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]


def _model(tmp_path: Path, config_template=None) -> Path:
    """The sample model with `config_template` as tokenizer_config's chat_template (None: none there)."""
    model = shutil.copytree(SAMPLE / "model", tmp_path / "model")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg.pop("chat_template")
    if config_template is not None:
        cfg["chat_template"] = config_template
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    return model


def _bundle(tmp_path: Path, name: str, **extra) -> Path:
    d = shutil.copytree(SAMPLE / "policies" / "pii", tmp_path / name)
    meta = json.loads((d / "policy.json").read_text())
    (d / "policy.json").write_text(json.dumps({**meta, "name": name, **extra}))
    return d


def test_the_jinja_file_transformers_writes_wins_and_named_templates_are_found(tmp_path):
    model = _model(tmp_path, [{"name": "default", "template": "CFG{{ messages[0].content }}"},
                              {"name": "tool_use", "template": "TOOL{{ messages[0].content }}"}])
    (model / "chat_template.jinja").write_text("JINJA{{ messages[0].content }}")
    (model / "additional_chat_templates").mkdir()
    (model / "additional_chat_templates" / "guard.jinja").write_text("GUARD{{ messages[0].content }}")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    assert sorted(model_templates(model, cfg)) == ["default", "guard", "tool_use"]
    enc = TextEncoder(model, fast=False)
    assert enc.render(MESSAGES) == "JINJAhi" and enc.describe_template()["source"].endswith("chat_template.jinja")
    assert TextEncoder(model, fast=False, chat_template="tool_use").render(MESSAGES) == "TOOLhi"
    assert TextEncoder(model, fast=False, chat_template="guard").render(MESSAGES) == "GUARDhi"


def test_chat_template_option_takes_plain_a_file_or_a_name_and_refuses_anything_else(tmp_path, monkeypatch):
    model = _model(tmp_path, "M{{ messages[0].content }}")
    (tmp_path / "mine.jinja").write_text("F{% for m in messages %}{{ m.role }}{% endfor %}")
    monkeypatch.chdir(tmp_path)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    plain = choose_template(model, cfg, "plain")
    assert plain.render(MESSAGES) == "user: hi\nassistant: yo" and plain.describe() == {"source": "plain",
                                                                                           "sha256": None}
    mine = choose_template(model, cfg, "mine.jinja")
    assert mine.render(MESSAGES) == "Fuserassistant" and mine.origin == str(tmp_path / "mine.jinja")
    assert choose_template(model, cfg, "default").render(MESSAGES) == "Mhi"
    with pytest.raises(TemplateChoiceError, match=r"--chat-template 'nope': no such file .* \(it has: default\)"):
        choose_template(model, cfg, "nope")


def test_a_policy_names_its_template_relative_to_its_bundle_and_policies_must_agree(tmp_path):
    model = _model(tmp_path, "M{{ messages[0].content }}")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    guard = _bundle(tmp_path, "guard", chat_template="conv.jinja")
    (guard / "conv.jinja").write_text("{% for m in messages %}{{ m.role | title }}: {{ m.content }}\n{% endfor %}")
    twin = _bundle(tmp_path, "twin", chat_template="conv.jinja")
    shutil.copy(guard / "conv.jinja", twin / "conv.jinja")
    chosen = choose_template(model, cfg, None, [load_policy(guard), load_policy(twin)])
    assert chosen.render(MESSAGES) == "User: hi\nAssistant: yo\n"  # the same text in two bundles: one template
    plain = _bundle(tmp_path, "plainly", chat_template="plain")
    with pytest.raises(TemplateChoiceError, match=r"different chat templates \(guard: .*conv.jinja; plainly: plain"):
        choose_template(model, cfg, None, [load_policy(guard), load_policy(plain)])
    keyless = load_policy(SAMPLE / "policies" / "pii")  # wants the model's default, which is not plain
    with pytest.raises(TemplateChoiceError, match="pii: .*tokenizer_config.json"):
        choose_template(model, cfg, None, [load_policy(plain), keyless])
    assert choose_template(model, cfg, "plain", [load_policy(guard), keyless]).origin == "plain"  # the option wins


def test_a_policys_template_must_lie_in_its_folder(tmp_path):
    """A policy.json that names a file outside its folder (a path up and out, an absolute one, a link inside that
    points out) would score every row on that file's text: refused, naming where it leads."""
    model = _model(tmp_path, "M{{ messages[0].content }}")
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    outside = tmp_path / "elsewhere.jinja"
    outside.write_text("{{ messages[0].content }} and more")
    for name, value in (("up", "../elsewhere.jinja"), ("absolute", str(outside)), ("link", "linked.jinja")):
        bundle = _bundle(tmp_path, name, chat_template=value)
        (bundle / "linked.jinja").symlink_to(outside)
        with pytest.raises(TemplateChoiceError, match=rf"names {outside}, outside the policy's folder"):
            choose_template(model, cfg, None, [load_policy(bundle)])
    inside = _bundle(tmp_path, "inside", chat_template="sub/t.jinja")
    (inside / "sub").mkdir()
    (inside / "sub" / "t.jinja").write_text("T{{ messages[0].content }}")
    assert choose_template(model, cfg, None, [load_policy(inside)]).render(MESSAGES) == "Thi"


def _score(*args) -> object:
    return CliRunner().invoke(cli, ["score", *map(str, args), "--no-progress", "--device", "cpu"])


def _messages_log(path: Path, n: int = 3) -> Path:
    path.write_text("".join(json.dumps({"id": i, "messages": MESSAGES}) + "\n" for i in range(n)))
    return path


def test_messages_without_a_template_are_a_usage_error_naming_chat_template_plain(tmp_path):
    model = _model(tmp_path)
    log = _messages_log(tmp_path / "a.jsonl")
    out = tmp_path / "o.parquet"
    res = _score(log, "--model", model, "-o", out)  # the column is guessed: still refused before scoring
    assert res.exit_code == 2 and "--chat-template plain" in res.output and "a.jsonl" in res.output, res.output
    assert not out.exists()
    texts = tmp_path / "t.jsonl"
    texts.write_text(json.dumps({"id": 1, "text": "hello there"}) + "\n")
    assert _score(texts, "--model", model, "-o", out).exit_code == 0  # text needs no template
    res = _score(log, "--model", model, "-o", tmp_path / "p.parquet", "--chat-template", "nope")
    assert res.exit_code == 2 and "it has: none" in res.output, res.output


def test_plain_and_the_jinja_file_are_used_and_recorded_in_the_metadata(tmp_path):
    model = _model(tmp_path)
    log = _messages_log(tmp_path / "a.jsonl")
    res = _score(log, "--model", model, "-o", tmp_path / "plain.parquet", "--chat-template", "plain")
    assert res.exit_code == 0, res.output
    meta = read_metadata(tmp_path / "plain.parquet")
    assert meta["chat_template"] == {"source": "plain", "sha256": None}
    (model / "chat_template.jinja").write_text("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}")
    assert _score(log, "--model", model, "-o", tmp_path / "jinja.parquet").exit_code == 0
    meta = read_metadata(tmp_path / "jinja.parquet")
    assert meta["chat_template"]["source"] == str(model / "chat_template.jinja")
    assert len(meta["chat_template"]["sha256"]) == 64


# A template in the style of newer Qwen and Llama ones: loop controls, generation blocks, tools tested for, tool
# calls through tojson, and reasoning
TRANSFORMERS_STYLE = (
    "{% if tools is defined and tools is not none %}tools: {{ tools | tojson }}\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}<|{{ m.role }}|>"
    "{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>{% endif %}"
    "{% generation %}{{ m.content }}{% endgeneration %}"
    "{% if 'tool_calls' in m %}{% for t in m.tool_calls %}{{ t.function | tojson }}{% if loop.index > 1 %}"
    "{% break %}{% endif %}{% endfor %}{% endif %}\n{% endfor %}")


def _with_transformers(tmp_path: Path, template: str):
    """transformers' chat-template helpers (the test skips without them) and the sample model with `template`."""
    hf = pytest.importorskip("transformers.utils.chat_template_utils")
    needed = ("_compile_jinja_template", "_normalize_chat_messages", "_alias_reasoning_fields")
    if not all(hasattr(hf, f) for f in needed):
        pytest.skip("this transformers does not normalize messages before its chat templates")
    model = tmp_path / "m"
    model.mkdir()
    shutil.copy(SAMPLE / "model" / "tokenizer.json", model / "tokenizer.json")
    cfg = json.loads((SAMPLE / "model" / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": template}))
    return hf, model


def test_templates_render_as_transformers_renders_them(tmp_path):
    """The same template and messages through transformers' own chat-template compiler give the same text:
    loop controls, generation blocks, tools passed as none, tojson without HTML escapes and in key order, null
    fields left out, reasoning aliased."""
    hf, model = _with_transformers(tmp_path, TRANSFORMERS_STYLE)
    calls = [{"type": "function", "function": {"name": "find", "arguments": {"z": "a < b & c", "a": ["é", 1]}}}] * 3
    messages = [{"role": "system", "content": "Be brief.", "tool_calls": None},
                {"role": "skip", "content": "never shown"},
                {"role": "user", "content": "Find it > now", "tool_calls": None},
                {"role": "assistant", "content": "Calling.", "tool_calls": calls, "reasoning": "look it up"}]
    ours = TextEncoder(model).render(messages)
    normalized = hf._alias_reasoning_fields(hf._normalize_chat_messages(messages))
    theirs = hf._compile_jinja_template(TRANSFORMERS_STYLE).render(messages=normalized, tools=None, documents=None,
                                                                     bos_token="", add_generation_prompt=False)
    assert ours == theirs


PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.content is string %}{{ m.content }}"
                  "{% elif m.content is defined %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endif %}"
                  "{% for t in m.tool_calls or [] %}{{ t.function | tojson }}{% endfor %}\n{% endfor %}")


def test_openai_shaped_messages_render_as_transformers_renders_them(tmp_path):
    """Content as a list of text parts (OpenAI, Gemma 3), and null beside tool calls (an assistant turn that only
    calls tools): rendered as transformers renders them, text parts marked as string content is, so a special-token
    string typed in one stays text."""
    hf, model = _with_transformers(tmp_path, PARTS_TEMPLATE)
    enc = TextEncoder(model)
    messages = [{"role": "user", "content": [{"type": "text", "text": "Find "}, {"type": "text", "text": "it"}]},
                {"role": "assistant", "content": None,
                 "tool_calls": [{"type": "function", "function": {"name": "find", "arguments": {"q": "it"}}}]}]
    theirs = hf._compile_jinja_template(PARTS_TEMPLATE).render(messages=hf._normalize_chat_messages(messages),
                                                               bos_token="", add_generation_prompt=False)
    assert enc.render(messages) == theirs
    forged = [{"role": "user", "content": [{"type": "text", "text": "hi <|eos|>"}, {"type": "text", "text": "x"}]}]
    assert [i for i in enc.encode(enc.render(forged)) if i in enc.special_ids] == []


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": None}, "null content is taken beside tool_calls only"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}, "other parts (images, audio)"),
    ({"role": "user", "content": []}, "neither a string nor a list of text parts")])
def test_a_message_whose_content_cannot_be_scored_is_that_rows_error(tmp_path, message, says):
    from policyscan.engine.inputs.rows import conversation

    text, why = conversation([{"role": "system", "content": "s"}, message], True, lambda v: "unused")
    assert text is None and why.startswith("message 1 ") and says in why, why


def test_the_plain_template_refuses_content_that_is_not_a_string():
    from policyscan.engine.text.chat_template import PLAIN, ChatTemplate

    with pytest.raises(ValueError, match="plain template renders string contents; message 0's is list"):
        ChatTemplate(None, PLAIN).render([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])
