"""`score` and `inspect` on bad inputs, through the CLI on the sample model with a few rows: bad rows cost their own
line, `-o DIR/` inside the archive never reads its own outputs, a broken chat template is reported once,
`inspect` gives line numbers and lists a folder of policy bundles."""
from __future__ import annotations

import json
import shutil

from cli_cases import SAMPLE, run
from click.testing import CliRunner

from policyscan.cli.main import cli


def test_bad_bytes_missing_field_and_surrogates_cost_their_lines_only(tmp_path):
    src = tmp_path / "logs.jsonl"
    src.write_bytes(b"\n".join([
        json.dumps({"id": "a", "note": "no text field"}).encode(),
        json.dumps({"id": "b", "text": "user: hello there"}).encode(),
        b'{"id": "c", "text": "bad \xff byte"}',
        b'{"id": "d", "text": "lone \\ud800 surrogate"}',
        b'{"id": "e\\udc00", "text": "fine text, bad id"}',
        json.dumps({"id": "f", "text": "user: and goodbye"}).encode()]) + b"\n")
    out = tmp_path / "o.parquet"
    res = run("score", src, "-o", out, "--no-progress", ok=(3,))
    assert "rows in 6 = scored 2 + in errors 4 (balanced)" in res.output
    errors = [json.loads(x) for x in (tmp_path / "o.parquet.errors.jsonl").read_text().splitlines()]
    assert [(e["line"], e["id"]) for e in errors] == [(1, "a"), (3, "logs.jsonl:3"), (4, "d"), (5, "e\\udc00")]
    assert "no field 'text'" in errors[0]["reason"] and "invalid UTF-8" in errors[1]["reason"]
    assert "lone surrogate" in errors[2]["reason"] and "lone surrogate" in errors[3]["reason"]


def test_score_dir_into_itself_never_reads_its_own_outputs(tmp_path):
    arch = tmp_path / "arch"
    arch.mkdir()
    (arch / "a.jsonl").write_text(json.dumps({"text": "user: hi"}) + "\n" + json.dumps({"text": ""}) + "\n")
    args = ("score", arch, "-o", f"{arch}/scores/", "--format", "jsonl", "--no-progress")
    run(*args, ok=(3,))
    made = sorted(p.name for p in (arch / "scores").iterdir())
    assert made == ["a.scores.jsonl", "a.scores.jsonl.errors.jsonl", "a.scores.jsonl.meta.json"]
    res = run(*args)  # the next night: the log is up to date, and nothing else is an input
    assert "up to date" in res.output and "rows in 0 = scored 0 + in errors 0 (balanced)" in res.output
    assert sorted(p.name for p in (arch / "scores").iterdir()) == made


def test_chat_template_syntax_error_is_reported_once_before_scoring(tmp_path):
    model = tmp_path / "model"
    shutil.copytree(SAMPLE / "model", model)
    cfg = json.loads((model / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{% for m in messages %}{{ m.content }\n{% endfor %}"
    (model / "tokenizer_config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o.parquet"
    res = CliRunner().invoke(cli, ["score", str(SAMPLE / "conversations.jsonl"), "--model", str(model),
                                   "-o", str(out), "--no-progress"])
    assert res.exit_code == 1 and res.output.count("the chat template does not compile (line 1 of the template") == 1
    assert "tokenizer_config.json" in res.output and not out.exists()


def test_inspect_jsonl_names_its_bad_lines(tmp_path):
    src = tmp_path / "a.jsonl"
    src.write_bytes(b'{"id": 1, "text": "x"}\n\n{"id": 2, "text": \n{"id": "3", "text": "\xfe"}\n[1]\n')
    got = json.loads(run("inspect", src).output)
    assert got["rows"] == 4 and got["bad_lines"] == 3
    assert [b["line"] for b in got["first_bad_lines"]] == [3, 4, 5]
    assert "malformed JSON" in got["first_bad_lines"][0]["reason"] and "UTF-8" in got["first_bad_lines"][1]["reason"]
    assert got["columns"] == {"id": "number", "text": "string"}


def test_inspect_lists_a_folder_of_policy_bundles():
    got = json.loads(run("inspect", SAMPLE / "policies").output)
    assert [p["policy"] for p in got["policies"]] == ["investment_advice", "pii"]
    assert all(p["adapter_sha256"] and p["lora_ranks"] for p in got["policies"])


def test_text_is_rendered_on_a_messages_column_is_a_usage_error(tmp_path):
    """The flag declares text columns of rendered prompts; a messages column, named or found, would ignore it."""
    src = tmp_path / "chats.jsonl"
    src.write_text(json.dumps({"id": "a", "messages": [{"role": "user", "content": "hi"}]}) + "\n")
    out = tmp_path / "o.parquet"
    for extra in ((), ("--messages-column", "messages")):
        res = run("score", src, "-o", out, "--text-is-rendered", "--chat-template", "plain", *extra, ok=(2,))
        assert f"--text-is-rendered declares text columns of prompts rendered with their markup, but {src} holds its " \
               "conversations in a messages column" in " ".join(res.output.split())
        assert not out.exists()
    text = tmp_path / "texts.jsonl"
    text.write_text(json.dumps({"id": "b", "text": "user: hi"}) + "\n")
    assert "rows in 1 = scored 1" in run("score", text, "-o", out, "--text-is-rendered", "--no-progress").output
