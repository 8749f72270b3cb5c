"""Content never becomes control: the text of a conversation is marked so that a special-token string typed in it
stays text, while the scaffolding (the chat template's markup, a policy's prefix and suffix) keeps its control tokens.

The marks are two Unicode noncharacters, ESC and BRK, which no text needs. In content, a literal mark is doubled,
a special-token string gets ESC before it, and where the content's trimmed start or end could join the template's
markup into a special token (its start ends one, its end begins one, or the markup on both sides could close one
around it), a BRK breaks the seam. A chat template renders such marked strings as it renders any text (its
`trim` leaves the marks in place: they sit inside the whitespace), and `ContentGuard.pieces` reads the result back
into text runs and the markup's own special tokens. Marks survive only where text passes through unchanged; a
template that rewrites content (say, JSON-escapes it) is caught by `ContentGuard.check_markup`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from policyscan.engine.errors import InputError
from policyscan.engine.text.chat_template import ChatTemplate
from policyscan.engine.text.follow import Text, checking, strings

ESC = "\ufdd0"  # before a special-token string of content: it is text
BRK = "\ufdd1"  # a seam break: nothing matches across it
NO_TEMPLATE = "the model ships no chat template and no --chat-template or policy chat_template names one"
REWRITES = ("the chat template rewrites message contents (escapes or cuts them), so the special-token strings "
            "in them cannot be told from the template's own control tokens; such a conversation cannot be scored "
            "with this template")
_UNMARK = re.compile(f"{ESC}{ESC}|{BRK}{BRK}|{ESC}|{BRK}")  # a doubled mark is the literal mark, a single one nothing
STAND_IN = "\ufffd"  # what a special-token string in content becomes in the render that finds the markup's tokens
# roles that chat templates test by name; they hold no special-token string, so they pass unmarked
STANDARD_ROLES = frozenset({"system", "user", "assistant", "tool", "function", "developer", "ipython"})


@dataclass(frozen=True)
class SpecialToken:
    content: str
    id: int
    lstrip: bool = False  # the token takes the whitespace before it (tokenizers' AddedToken.lstrip)
    rstrip: bool = False  # and after it


@dataclass(frozen=True)
class ContentGuard:
    """The tokenizer's special tokens, and the marking and reading of content around them."""

    specials: tuple[SpecialToken, ...]
    _by_content: dict = field(init=False, repr=False, compare=False)
    _find: re.Pattern | None = field(init=False, repr=False, compare=False)
    _read: re.Pattern = field(init=False, repr=False, compare=False)
    _heads: frozenset = field(init=False, repr=False, compare=False)
    _tails: frozenset = field(init=False, repr=False, compare=False)
    _inner: frozenset = field(init=False, repr=False, compare=False)
    _longest: int = field(init=False, repr=False, compare=False)
    _firsts: frozenset = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for s in self.specials:
            if not s.content or any(c in s.content for c in (ESC, BRK, STAND_IN)):
                raise ValueError(f"special token {s.content!r} (id {s.id}) is empty or holds U+FDD0, U+FDD1 or U+FFFD")
        by_content = {s.content: s for s in self.specials}
        alternation = "|".join(re.escape(c) for c in sorted(by_content, key=lambda c: (-len(c), c)))
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731 (frozen dataclass fields derived once)
        set_("_by_content", by_content)
        set_("_find", re.compile(alternation) if alternation else None)
        # a doubled mark: the literal character; ESC + special: text; a lone mark: nothing; a bare special: control
        marks = f"{ESC}{ESC}|{BRK}{BRK}|" + (f"{ESC}(?:{alternation})|" if alternation else "") + f"{ESC}|{BRK}"
        set_("_read", re.compile(f"{marks}|({alternation})" if alternation else marks))
        set_("_heads", frozenset(c[:k] for c in by_content for k in range(1, len(c))))
        set_("_tails", frozenset(c[k:] for c in by_content for k in range(1, len(c))))
        set_("_inner", frozenset(c[i:j] for c in by_content for i in range(1, len(c)) for j in range(i + 1, len(c))))
        set_("_longest", max(map(len, by_content), default=0))
        set_("_firsts", frozenset(c[0] for c in by_content))  # a text without any of these holds none

    @classmethod
    def of_tokenizer(cls, tok) -> "ContentGuard":
        """From a `tokenizers.Tokenizer`: its added tokens marked special."""
        added = tok.get_added_tokens_decoder()
        return cls(tuple(SpecialToken(t.content, i, bool(t.lstrip), bool(t.rstrip))
                         for i, t in sorted(added.items()) if t.special))

    def mark(self, text: str) -> str:
        """Content -> marked content: its special-token strings and its seams with the markup stay text."""
        text = self.escape(text)
        if self._find is None:
            return text
        if self._find.search(text):
            text = self._find.sub(lambda m: ESC + m.group(), text)
        return self.seal(text)

    def seal(self, text: str) -> str:
        """`text` with a seam mark (BRK) at each trimmed edge that could close a special-token string with the
        markup beside it."""
        core = text.strip()
        if not core or self._find is None:
            return text
        start = len(text) - len(text.lstrip())
        end = start + len(core)
        span = range(1, min(self._longest, len(core) + 1))
        inner = len(core) < self._longest and core in self._inner  # markup on both sides could close around it
        if inner or any(core[-k:] in self._heads for k in span):
            text = text[:end] + BRK + text[end:]
        if inner or any(core[:k] in self._tails for k in span):
            text = text[:start] + BRK + text[start:]
        return text

    def escape(self, text: str) -> str:
        """A trusted rendered text: its special-token strings stay control, a literal mark stays text."""
        for mark in (ESC, BRK):
            if mark in text:
                text = text.replace(mark, mark + mark)
        return text

    def stand_in(self, text: str) -> str:
        """Content marked as `mark` does, each special-token string replaced by U+FFFD (see check_markup)."""
        return self.mark(text if self._find is None else self._find.sub(STAND_IN, text))

    def holds_special(self, text: str) -> bool:
        """Whether `text` holds a special-token string."""
        return self._find is not None and self._find.search(text) is not None

    def count(self, texts: list[str]) -> int:
        """How many special-token strings the texts hold (marked or bare), none across two of them."""
        text = ESC.join(texts)  # no special-token string holds ESC (__post_init__)
        if self._find is None or not any(c in text for c in self._firsts):
            return 0
        return sum(1 for _ in self._find.finditer(text))

    @property
    def marks(self) -> str:
        return ESC + BRK

    def crossing(self, text: str, seams: list[int]) -> int:
        """How many special-token strings of `text` start before and end after one of the positions `seams`
        (only the characters around each seam are read)."""
        if self._find is None:
            return 0
        found = set()
        reach = self._longest - 1
        for at in seams:
            lo = max(0, at - reach)
            for m in self._find.finditer(text, lo, at + reach):
                if m.start() < at < m.end():
                    found.add(m.start())
        return len(found)

    def needs_reading(self, text: str) -> bool:
        """Whether `text` holds marks (else its special-token strings are all control, as tokenizers reads them)."""
        return ESC in text or BRK in text

    def pieces(self, text: str) -> list[str | int]:
        """A marked text -> text runs (marks removed) and the ids of its bare special tokens, in order; a special
        token that strips whitespace takes it from the runs beside it, as tokenizers does."""
        out: list[str | int] = []
        run: list[str] = []
        at = 0
        for m in self._read.finditer(text):
            run.append(text[at:m.start()])
            at = m.end()
            token = m.group(1) if m.re.groups else None
            if token is None:
                got = m.group()
                run.append(got[0] if got in (ESC + ESC, BRK + BRK) else got[1:])
                continue
            special = self._by_content[token]
            before = "".join(run)
            out.append(before.rstrip() if special.lstrip else before)
            out.append(special.id)
            run = []
            if special.rstrip:
                rest = text[at:]
                at += len(rest) - len(rest.lstrip())
        out.append("".join(run) + text[at:])
        return [p for p in out if p != ""]

    def markup_ids(self, text: str) -> list[int]:
        """The ids of the bare special tokens of a marked text, in order."""
        return [p for p in self.pieces(text) if isinstance(p, int)]

    def check_passed_through(self, marked: str, honest: str) -> None:
        """Refuse a rendering of marked contents that, marks taken out, is not the rendering of the contents as
        they are: the template escaped, cut or rewrote them (JSON-escaped marks would be read as text)."""
        if _UNMARK.sub(lambda m: m.group()[1:], marked) != honest:
            raise ValueError(REWRITES)

    def check_markup(self, marked: str, stood_in: str) -> None:
        """Refuse a rendering whose markup tokens differ from those of the same messages with U+FFFD for each special
        string: the template changed the content's marks (JSON-escaped it, cut it), so they cannot be trusted."""
        if self.markup_ids(marked) != self.markup_ids(stood_in):
            raise ValueError(REWRITES)


@dataclass(frozen=True)
class Conversations:
    """A conversation cell -> the marked text the encoder reads: a text's special-token strings stay text (unless
    the texts are trusted renderings, `text_is_rendered`); a messages list is rendered through the run's chat
    template with every string of every message marked, so only the template's markup holds control tokens. The
    strings reach the template as follow.Text, so a step that would make a special-token string of them is refused."""

    template: ChatTemplate | None
    guard: ContentGuard
    text_is_rendered: bool = False
    _keys: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # key -> its Text

    def __call__(self, value: str | list[dict]) -> str:
        if isinstance(value, str):
            return self.guard.escape(value) if self.text_is_rendered else self.guard.mark(value)
        if self.template is None:  # the CLI refuses this before scoring; a row error for other callers
            raise InputError(f"{NO_TEMPLATE}; pass --chat-template plain for 'role: content' lines")
        value = [_as_transformers_passes(m) for m in value]
        marked = [self._each(m, self.guard.mark) for m in value]
        with checking(self.guard):
            text = str(self.template.render(marked))  # a plain str: a Text's pieces are followed, at a cost
        texts = strings(marked)
        if any(self.guard.needs_reading(v) for v in texts):
            self.guard.check_passed_through(text, self.template.render(value))
            if any(ESC in v for v in texts):  # a special string marked
                with checking(self.guard):
                    stood_in = self.template.render([self._each(m, self.guard.stand_in) for m in value])
                self.guard.check_markup(text, stood_in)
        return text

    def _each(self, message: dict, how) -> dict:
        """Every string of a message marked, but a standard role: templates compare it (role == 'tool'), and a
        seam mark (say, 'tool' inside a '<tool_call>' token) would send the message down the wrong branch. Below the
        top level (a tool call's name, id and arguments, which templates render, compare, measure and `tojson`) a
        string is marked only when it holds a special-token string: seam marks there would change an id's length or
        a compared value, and no template writes such values beside markup they could complete. Keys are looked up
        by name, so they cannot be marked: a key that holds a special-token string is refused."""
        return {self._key(k): v if k == "role" and isinstance(v, str) and v in STANDARD_ROLES
                else Text(how(v)) if isinstance(v, str)
                else [self._part(p, how) for p in v] if k == "content" and isinstance(v, list)
                else self._deep(v, how) for k, v in message.items()}

    def _part(self, part, how):
        """A part of a content list ({type: "text", text: ...}): its text is content, marked as a string content is."""
        if not isinstance(part, dict):
            return self._deep(part, how)
        return {self._key(k): Text(how(v)) if k == "text" and isinstance(v, str) else self._deep(v, how)
                for k, v in part.items()}

    def _deep(self, v, how):
        if isinstance(v, str):
            return Text(how(v) if self.guard.holds_special(v) else v)
        if isinstance(v, (list, tuple)):  # a Parquet map arrives as a list of (key, value) tuples
            return type(v)(self._deep(x, how) for x in v)
        if isinstance(v, dict):
            return {self._key(k): self._deep(x, how) for k, x in v.items()}
        return v

    def _key(self, k):
        """A key as the template sees it: Text, followed as values are (a template may print a tool call's argument
        names), unmarked, since it is looked up by name."""
        if not isinstance(k, str):
            return k
        if (text := self._keys.get(k)) is None:  # the same few keys in every message
            if self.guard.holds_special(k):
                raise InputError(f"a message holds the key {_shown(k)}, which holds a special-token string; keys "
                                 "are looked up by name, so they cannot be marked as text: rename the key or drop the "
                                 "field")
            text = Text(k)
            if len(self._keys) < 4096:
                self._keys[k] = text
        return text


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning


def _as_transformers_passes(message: dict) -> dict:
    """A message as transformers hands it to a chat template: keys whose value is None dropped (a Parquet struct
    gives every message every field; templates test `'tool_calls' in message`), and the reasoning under each of the
    names templates read, `reasoning_content` and `thinking`."""
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in REASONING_KEYS if k in message), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _shown(k: str) -> str:
    """A key as a message quotes it: repr, cut at 60 characters."""
    return repr(k if len(k) <= 60 else k[:57] + "...")
