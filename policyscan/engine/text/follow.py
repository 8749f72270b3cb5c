"""A message's text followed through a chat template, so that no template step makes a control token out of it.

The marks (engine/text/content.py) keep special-token strings typed in content as text, and keep content's edges
from closing one with the template's markup. A template that transforms content could still make a new one out of
text that held none: `lower` on '<|EOS|>', a `replace` or `join` that closes '<|e os|>' up, two slices printed side
by side. So a message's strings reach the template as `Text`, and while `checking` holds the run's `Checks`:
- what a filter, str method, `%`, `*`, `+`, `~`, slice or loop makes of a Text is Text again;
- a step that builds from parts (`~`, `+`, `*`, join) is refused if a special-token string crosses an edge of a
  part that is Text (only the characters around each edge are read, so a loop that accumulates a string stays
  linear), or if two marks meet there and would read as one literal character;
- any other filter or str method is refused if its result holds more special-token strings than its inputs, Text
  or not (a `{% filter lower %}` block's body is rendered to a plain string first), but for selections and
  substrings (SELECTING), which make none; `format` and `%` only where an input holds Text, since templates build
  role tokens with them;
- a slice that cuts a mark from what it marks is refused, and one with a step is checked as a filter is;
- the template's output is checked as a step that builds from parts: a Text printed with `{{ }}` stays Text until
  the output, a macro's, a `{% set %}` block's or a filter block's body, is joined, so that pieces printed side by
  side cannot close one either;
- `str.encode` is refused, and sandbox.py refuses bytes and `%c`: text turned into bytes, or a character made of a
  number, cannot be followed.
A refusal is the row's error (ContentControlError)."""
from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Protocol

BUILDING = frozenset({"format", "format_map", "join"})  # filters and str methods that build from parts
# filters and str methods whose strings are inputs or pieces of one (a selection, a split, a trim): nothing to count
SELECTING = frozenset({"select", "reject", "selectattr", "rejectattr", "list", "first", "last", "sort", "unique",
                       "dictsort", "items", "batch", "slice", "random", "groupby", "min", "max", "default", "d",
                       "attr", "map", "length", "count", "wordcount", "int", "float", "bool", "string", "trim",
                       "strip", "lstrip", "rstrip", "split", "rsplit", "splitlines", "partition", "rpartition",
                       "startswith", "endswith", "find", "rfind", "index", "rindex", "removeprefix",
                       "removesuffix", "isalpha", "isdigit", "isspace", "isupper", "islower", "isalnum", "istitle"})
_CHECKS: ContextVar[Checks | None] = ContextVar("template_checks", default=None)


class Checks(Protocol):
    """What the run's tokenizer says of texts (engine/text/content.py's ContentGuard)."""

    def count(self, texts: list[str]) -> int:
        """Special-token strings the texts hold, none across two of them."""

    marks: str  # the characters that mark content: two alike side by side read as one literal character

    def crossing(self, text: str, seams: list[int]) -> int:
        """Special-token strings of `text` that start before and end after one of the positions `seams`."""


class ContentControlError(ValueError):
    """A chat template step that would make a special-token string out of a message's text."""

    def __init__(self, step: str, what: str = "makes a special-token string out of a message's text, so that text "
                                              "would become control tokens"):
        super().__init__(f"the chat template's {step} {what}; such a conversation cannot be scored with this "
                         "template")


class Text(str):
    """A message's string as the template sees it: a str whose pieces stay Text."""

    def __getitem__(self, key) -> Text:  # Jinja slices without the environment
        made = Text(super().__getitem__(key))
        checks = _CHECKS.get()
        if checks is None:
            return made
        if not isinstance(key, slice):  # one character
            return _cut() if made in checks.marks else made
        if key.step not in (None, 1):  # every other character: a new string
            return transformed("slice with a step", (self,), made, strict=True)
        start, stop, _ = key.indices(len(self))
        marks = checks.marks
        if made and ((start and str.__getitem__(self, start - 1) in marks) or (stop < len(self) and made[-1] in marks)):
            _cut()
        return made

    def __iter__(self) -> Iterator[Text]:  # a template's loop over the characters: each stays Text
        return (Text(c) for c in str.__iter__(self))


@contextmanager
def checking(checks: Checks) -> Iterator[None]:
    """Within: template steps are followed and checked with `checks`."""
    token = _CHECKS.set(checks)
    try:
        yield
    finally:
        _CHECKS.reset(token)


def joined(step: str, parts: list, made):
    """`made`, built from `parts` side by side: refused if a special-token string crosses an edge of a part that is
    Text; Text if one is."""
    checks = _CHECKS.get()
    if checks is None or not isinstance(made, str) or not _tainted(parts):
        return made
    seams, at = set(), 0
    for p in parts:
        size = len(p) if isinstance(p, str) else len(str(p))
        if type(p) is Text or (isinstance(p, (list, tuple)) and _tainted(p)):
            seams.update((at, at + size))
        at += size
    seams.discard(0)
    seams.discard(at)
    if seams and checks.crossing(made, sorted(seams)):
        raise ContentControlError(step)
    if any(made[i - 1] == made[i] and made[i] in checks.marks for i in seams):  # a mark cut from its pair meets one
        raise ContentControlError(step, "joins two marks of a message's text into one character, which would make "
                                        "its special-token string control")
    return _as_text(made)


def transformed(step: str, inputs: tuple, made, strict: bool, also_held: int = 0):
    """`made`, what `step` made of `inputs`: refused if it holds more special-token strings than the inputs (and
    `also_held`, a replacement's repeats) where one input is Text, or any when `strict`; Text if one is."""
    checks = _CHECKS.get()
    if checks is None:
        return made
    tainted = _tainted(inputs)
    if tainted or strict:
        held_by_made = checks.count(strings((made,)))
        if held_by_made and held_by_made > checks.count(strings(inputs)) + also_held:
            raise ContentControlError(step)
    return _follow_result(made) if tainted else made


class Printed:
    """A Text printed by `{{ }}` (the environment's finalize): Jinja's str() of it gives the Text back, so that the
    output's join (the environment's concat) sees which pieces were content."""

    __slots__ = ("text",)

    def __init__(self, text: Text):
        self.text = text

    def __str__(self) -> str:
        return self.text


def printed(value):
    return Printed(value) if type(value) is Text and _CHECKS.get() is not None else value


def method(name: str, owner: str, args: tuple, kwargs: dict, call: Callable):
    """A str method called by the template, followed."""
    if name == "encode" and _CHECKS.get() is not None:
        raise ContentControlError("str.encode", "turns text into bytes, where a message's text cannot be followed")
    if name == "join" and args:  # the parts are counted, so a generator is read once here
        args = (_parts(args[0]), *args[1:])
        made = call(*args, **kwargs)
        return joined("str.join", _interleaved(args[0], owner), made) if isinstance(args[0], list) else made
    made = call(*args, **kwargs)
    if name in SELECTING:
        return _follow_result(made) if _tainted((owner, *args)) and _CHECKS.get() is not None else made
    also = _replaced(owner, args) if name == "replace" else 0
    return transformed(f"str.{name}", (owner, *args, *kwargs.values()), made, strict=name not in BUILDING,
                       also_held=also)


def followed_filter(name: str, f):
    """A filter whose result is followed; an iterator input read into a list first, so that it can be counted."""
    at = 1 if getattr(f, "jinja_pass_arg", None) else 0  # Jinja passes a marked filter's context first

    @functools.wraps(f)
    def followed(*args, **kwargs):
        if at < len(args):
            args = (*args[:at], (_parts if name == "join" else _listed)(args[at]), *args[at + 1:])
        values = (*args[at:], *kwargs.values())
        made = f(*args, **kwargs)
        if name == "join" and values and isinstance(values[0], list) and "attribute" not in kwargs:
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            return joined("join filter", _interleaved(list(values[0]), sep), made)
        if name in SELECTING:
            return _follow_result(made) if _CHECKS.get() is not None and _tainted(values) else made
        also = _replaced(values[0], values[1:3]) if name == "replace" and values else 0
        return transformed(f"{name} filter", values, made, strict=name not in BUILDING, also_held=also)
    return followed


def _interleaved(parts: list, sep) -> list:
    """A join's pieces with its separator between them, as they lie side by side."""
    out = []
    for i, p in enumerate(parts):
        if i and sep:
            out.append(sep)
        out.append(p)
    return out


def _replaced(owner, args) -> int:
    """The special-token strings a replace adds beyond one copy of its new text: one a further occurrence."""
    checks = _CHECKS.get()
    if checks is None or len(args) < 2 or not all(isinstance(a, str) for a in (owner, *args[:2])):
        return 0
    times = owner.count(args[0]) if args[0] else len(owner) + 1
    return checks.count([args[1]]) * max(times - 1, 0)


def _tainted(values) -> bool:
    """Whether a Text is among `values` or in their lists, tuples and dict values."""
    for v in values:
        if type(v) is Text:
            return True
        if isinstance(v, (list, tuple, dict)) and any(type(x) is Text for x in strings((v,))):
            return True
    return False


def _follow_result(made):
    """What a step made of a Text, as Text: a string, or the strings of a list or tuple (pieces of a split)."""
    if isinstance(made, (list, tuple)):
        return type(made)(_as_text(v) for v in made)
    return _as_text(made)


def _cut():
    raise ContentControlError("slice", "cuts a mark of a message's text from what it marks, which would make a "
                                       "special-token string typed there control")


def _as_text(v):
    return Text(v) if isinstance(v, str) and not isinstance(v, Text) else v  # Markup too: nothing is escaped


def strings(values) -> list[str]:
    """The strings among `values`, and in their lists, tuples and dict values at any depth (a message's, a step's
    inputs)."""
    out = []
    for v in values:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += strings(v)
        elif isinstance(v, dict):
            out += strings(v.values())
    return out


def _listed(v):
    """An iterator (a generator from `map`, say) read into a list; anything else as it is."""
    return list(v) if isinstance(v, Iterator) else v


def _parts(v):
    """What a join joins, as a list: a list's or tuple's items, a string's characters (Text if it is), a mapping's
    keys, a view's or an iterator's items."""
    return list(v) if hasattr(v, "__iter__") else v
