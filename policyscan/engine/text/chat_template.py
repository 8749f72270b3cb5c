"""Which chat template renders a messages column, and the template itself: compiled once in a sandboxed Jinja
environment, rendering each conversation within a time limit.

A run renders each conversation once, so it has one template: `--chat-template` if given, else the one its
policies' `chat_template` keys name (they must agree), else the model's default. Each is `plain` ("role: content"
lines), the name of one of the model's templates, or a Jinja file (a policy's is relative to its bundle)."""
from __future__ import annotations

import hashlib
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from policyscan.engine.errors import CheckpointError, PolicyscanError
from policyscan.engine.json_schema import CHAT_TEMPLATE_JSON, TOKENIZER_CONFIG, load
from policyscan.engine.text.sandbox import sandbox

RENDER_SECONDS = 2.0  # one conversation's chat template rendering, far above any real template's need
PLAIN = "plain"
TEMPLATE_FILE, TEMPLATE_DIR = "chat_template.jinja", "additional_chat_templates"  # what transformers writes


class TemplateChoiceError(PolicyscanError):
    """A --chat-template or policy.json chat_template that names no template, or policies that disagree."""


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template (source None: plain "role: content" lines) and where it came from.

    BOS is rendered empty: it is added as a token id, never through the text."""

    source: str | None
    origin: str  # a file, "tokenizer_config.json", "plain": what the output's metadata names
    eos_token: str = ""
    seconds: float = RENDER_SECONDS

    def __post_init__(self) -> None:
        if self.source is not None:
            _compile(self.source, self.origin)  # a syntax error is reported when the template is chosen

    @property
    def sha256(self) -> str | None:
        return None if self.source is None else hashlib.sha256(self.source.encode()).hexdigest()

    def describe(self) -> dict:
        return {"source": self.origin, "sha256": self.sha256}

    def render(self, messages: list[dict]) -> str:
        if self.source is None:
            for j, m in enumerate(messages):
                if not isinstance(m.get("content"), str):
                    raise ValueError(f"the plain template renders string contents; message {j}'s is "
                                     f"{type(m.get('content')).__name__}: name a chat template with --chat-template")
            return "\n".join(f"{m['role']}: {m['content']}" for m in messages)
        with _time_limit(self.seconds):
            return _compile(self.source, self.origin).render(messages=messages, bos_token="", tools=None,
                                                             documents=None, add_generation_prompt=False,
                                                             eos_token=self.eos_token)


def model_templates(model_dir: Path, tokenizer_config: dict) -> dict[str, tuple[str, str]]:
    """name -> (template, where it was read) for every template the model ships; later sources win, as in
    transformers: tokenizer_config.json (a string, or a list of {name, template}), chat_template.json,
    chat_template.jinja (the default), additional_chat_templates/NAME.jinja."""
    model_dir = Path(model_dir).resolve()  # the metadata names where a template came from, whatever the cwd
    out = config_templates(tokenizer_config, str(model_dir / "tokenizer_config.json"))
    legacy = model_dir / "chat_template.json"
    if legacy.is_file() and isinstance(source := load(legacy, CHAT_TEMPLATE_JSON, CheckpointError)
                                       .get("chat_template"), str):
        out["default"] = (source, str(legacy))
    if (jinja := model_dir / TEMPLATE_FILE).is_file():
        out["default"] = (jinja.read_text(encoding="utf-8"), str(jinja))
    if (named := model_dir / TEMPLATE_DIR).is_dir():
        out.update({p.stem: (p.read_text(encoding="utf-8"), str(p)) for p in sorted(named.glob("*.jinja"))})
    return out


def read_tokenizer_config(model_dir: Path) -> dict:
    """The model's tokenizer_config.json ({} when it has none), checked: a wrong type is one line naming the field."""
    path = Path(model_dir) / "tokenizer_config.json"
    return load(path, TOKENIZER_CONFIG, CheckpointError) if path.is_file() else {}


def config_templates(tokenizer_config: dict, where: str) -> dict[str, tuple[str, str]]:
    """The templates a tokenizer_config.json holds: a string (the default) or a list of {name, template}."""
    cfg = tokenizer_config.get("chat_template")
    if isinstance(cfg, str):
        return {"default": (cfg, where)}
    if isinstance(cfg, list):
        return {t["name"]: (t["template"], f"{where} ({t['name']})") for t in cfg
                if isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)}
    return {}


def choose_template(model_dir: Path, tokenizer_config: dict, choice: str | None,
                    policies: list = ()) -> ChatTemplate | None:
    """The run's template (see the module's docstring); None: there is none, and messages cannot be rendered."""
    eos = token_str(tokenizer_config.get("eos_token"))
    shipped = model_templates(model_dir, tokenizer_config)
    if choice is not None:
        return _named(choice, Path.cwd(), shipped, eos, "--chat-template")
    wanted = {p.name: (_named(p.chat_template, p.path, shipped, eos, f"policy {p.name!r} ({p.path}) chat_template",
                              inside=True) if p.chat_template is not None else _default(shipped, eos))
              for p in policies}
    if not any(p.chat_template is not None for p in policies):
        return _default(shipped, eos)
    distinct = {t.sha256 if t else "none": t for t in wanted.values()}
    if len(distinct) > 1:
        listed = "; ".join(f"{name}: {t.origin if t else 'none'}" for name, t in wanted.items())
        raise TemplateChoiceError(f"the policies render messages with different chat templates ({listed}); a run "
                                  "renders each conversation once: score them in separate runs, or pass "
                                  "--chat-template")
    return next(iter(distinct.values()))


def _default(shipped: dict[str, tuple[str, str]], eos: str) -> ChatTemplate | None:
    return ChatTemplate(*shipped["default"], eos) if "default" in shipped else None


def _named(value: str, base: Path, shipped: dict[str, tuple[str, str]], eos: str, what: str,
           inside: bool = False) -> ChatTemplate:
    """plain, a file (relative to `base`; with `inside`, a policy's, it must lie in that folder, links resolved), or
    the name of one of the model's templates."""
    if value == PLAIN:
        return ChatTemplate(None, PLAIN, eos)
    path = base / value
    if inside and path.exists() and not path.resolve().is_relative_to(base.resolve()):
        raise TemplateChoiceError(f"{what} {value!r} names {path.resolve()}, outside the policy's folder; a policy's "
                                  "template is a Jinja file in its folder, a name of the model's templates, or plain")
    if path.is_file():
        return ChatTemplate(path.read_text(encoding="utf-8"), str(path.resolve()), eos)
    if value in shipped:
        return ChatTemplate(*shipped[value], eos)
    names = ", ".join(sorted(shipped)) or "none"
    raise TemplateChoiceError(f"{what} {value!r}: no such file ({path}) and the model has no template of that "
                              f"name (it has: {names}); give a Jinja file, a template's name, or plain")


_TEMPLATES: dict[str, object] = {}


def _compile(template: str, where: str):
    if template not in _TEMPLATES:
        from jinja2 import TemplateSyntaxError

        env = sandbox()
        env.globals["raise_exception"] = _raise
        try:
            _TEMPLATES[template] = env.from_string(template)
        except TemplateSyntaxError as e:
            raise CheckpointError(f"{where}: the chat template does not compile (line {e.lineno} of the "
                                  f"template: {e.message}); fix chat_template, or pass --chat-template with "
                                  "another one (plain: 'role: content' lines)") from e
    return _TEMPLATES[template]


class RenderTimeout(Exception):
    """A chat template that ran past its time on one conversation."""


@contextmanager
def _time_limit(seconds: float) -> Iterator[None]:
    """Stop template code that runs past `seconds`: a trace function on the template's own frames (Jinja
    compiles it to Python named <template>) checks the clock on each line; other code runs untraced."""
    end = time.monotonic() + seconds

    def on_line(frame, event, arg):
        if event == "line" and time.monotonic() > end:
            raise RenderTimeout(f"rendering took over {seconds:g} s; does the chat template loop without end?")
        return on_line

    previous = sys.gettrace()
    sys.settrace(lambda frame, event, arg: on_line if frame.f_code.co_filename == "<template>" else None)
    try:
        yield
    finally:
        sys.settrace(previous)


def _raise(message: str):
    raise ValueError(f"chat template: {message}")


def token_str(tok) -> str:
    return tok.get("content", "") if isinstance(tok, dict) else (tok or "")
