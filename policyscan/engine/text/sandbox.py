"""The Jinja sandbox chat templates render in: Jinja's immutable sandbox, and a bound on what one template step may
build, so that a template cannot take a run's memory (the render's time limit cannot stop one allocation:
chat_template._time_limit).

Refused, as a render error of that row: repeating a string or list past BUILT_LIMIT items (`'x' * 10**9`), an
integer product or power past INT_BITS bits, padding past BUILT_LIMIT (`'x'.ljust(10**9)`, `center`, `indent`, a
`%` or `format` width or precision), and a replace that would grow a string past it. Real chat templates do none
of these; numbers in the data (a timestamp passed to `format`) are no sizes and pass.

Also refused, while `counting` says how to count the tokenizer's special-token strings: a filter, str method, `%`,
`+` or `~` that makes a special-token string out of a message's text (`lower` on '<|EOS|>', a `replace` or `join`
that closes '<|e os|>' up). A message's strings reach the template as `Text`; what a step makes of a Text is Text
again (its pieces, its lower-case), so the check follows the content through the template. A filter other than
`format` and `join` may make none out of any text, Text or not: a `{% filter lower %}` block's body is rendered
into a plain string first."""
from __future__ import annotations

import functools
import re
import string
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

BUILT_LIMIT = 1 << 24  # items one step may build: far past any conversation's rendering
INT_BITS = 1 << 16  # bits of an integer a product or power may make
# the str methods and filters whose integer arguments are sizes of what they build
PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
PADDING_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[a-zA-Z%]")
_SPEC_WIDTH = re.compile(r"^(?:.?[<>=^])?[-+ ]?#?0?(\d+)?[,_]?(?:\.(\d+))?")
_COUNT: ContextVar[Callable[[list[str]], int] | None] = ContextVar("special_token_count", default=None)
BUILDING_FILTERS = frozenset({"format", "join"})  # build from parts, as `~` does: checked where a part is Text


class TemplateLimitError(ValueError):
    """A chat template step that would build more than the sandbox allows."""


class ContentControlError(ValueError):
    """A chat template step that would make a special-token string out of a message's text."""


class Text(str):
    """A message's string as the template sees it: a str whose pieces stay Text."""

    def __getitem__(self, key) -> "Text":  # Jinja slices without the environment: a piece stays Text
        return Text(super().__getitem__(key))

    def __iter__(self) -> Iterator["Text"]:  # a template's loop over the characters: each stays Text
        return (Text(c) for c in str.__iter__(self))


@contextmanager
def counting(count: Callable[[list[str]], int]) -> Iterator[None]:
    """Within: template steps are checked with `count`, which says how many special-token strings texts hold."""
    token = _COUNT.set(count)
    try:
        yield
    finally:
        _COUNT.reset(token)


def sandbox():
    """A new ImmutableSandboxedEnvironment whose steps are bounded and followed as the module says."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Following(CodeGenerator):
        """`~` compiled to the environment's concat instead of a bare join, so that what it makes of a Text is
        Text (Jinja's own join has no hook)."""

        def visit_Concat(self, node, frame) -> None:
            self.write("environment.concat((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        code_generator_class = Following

        def concat(self, values: tuple) -> str:
            return _follow("'~'", values, "".join(map(str, values)))

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            made = super().call_binop(context, operator, left, right)
            return _follow(f"'{operator}'", (left, right), made) if operator in ("%", "+") else made

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  Jinja's own signature
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands str.format out wrapped
            owner = getattr(method, "__self__", None)
            if not isinstance(owner, str):  # a macro or a global: its own markup is the template's
                return super().call(__context, __obj, *args, **kwargs)
            _check_method(method.__name__, owner, args, kwargs)
            if method.__name__ == "join" and args:  # its pieces are counted, so a generator is read once here
                args = (_listed(args[0]), *args[1:])
                made = super().call(__context, __obj, *args, **kwargs)
                return _follow("str.join", (owner, *args), made, joined=(owner, args[0]))
            made = super().call(__context, __obj, *args, **kwargs)
            return _follow(f"str.{method.__name__}", (owner, *args, *kwargs.values()), made)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _followed_filter(name, _bounded_filter(name, f)) for name, f in env.filters.items()}
    return env


def _follow(step: str, inputs: tuple, made, joined: tuple[str, list] | None = None, strict: bool = False):
    """`made`, what `step` built from `inputs`: refused if one of them is a message's Text (any, when `strict`) and
    `made` holds more special-token strings than the inputs (a join's separator, `joined`, counted once a seam),
    else Text again where it came from a Text, so that later steps are checked too."""
    count = _COUNT.get()
    if count is None:
        return made
    strings = _strings(inputs)
    tainted = any(type(v) is Text for v in strings)
    if not (tainted or strict):
        return made
    held_by_made = count(_strings((made,)))
    if held_by_made:
        held = count(strings)
        if joined is not None:
            pieces = _strings((joined[1],))
            held = count(pieces) + count(_strings(joined[:1])) * max(len(pieces) - 1, 0)
        if held_by_made > held:
            raise ContentControlError(
                f"the chat template's {step} makes a special-token string out of a message's text, so that text "
                "would become control tokens; such a conversation cannot be scored with this template")
    if not tainted:
        return made
    if isinstance(made, str) and not isinstance(made, Text):
        return Text(made)
    if isinstance(made, (list, tuple)) and any(isinstance(v, str) for v in made):
        return type(made)(Text(v) if isinstance(v, str) and not isinstance(v, Text) else v for v in made)
    return made


def _strings(values) -> list[str]:
    """The strings among `values` and one level into their lists and tuples (a join's pieces)."""
    out = []
    for v in values:
        if isinstance(v, str):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += [x for x in v if isinstance(x, str)]
    return out


def _listed(v):
    """An iterable that is no str, list, tuple or mapping, read into a list (a generator from `map`)."""
    return v if isinstance(v, (str, list, tuple, dict)) or not hasattr(v, "__iter__") else list(v)


def _followed_filter(name: str, f):
    """A filter whose result is checked and followed as _follow says; join's pieces read once and counted."""
    at = 1 if getattr(f, "jinja_pass_arg", None) else 0  # Jinja passes a marked filter's context first

    @functools.wraps(f)
    def followed(*args, **kwargs):
        if name == "join" and at < len(args):
            args = (*args[:at], _listed(args[at]), *args[at + 1:])
        values = (*args[at:], *kwargs.values())
        made = f(*args, **kwargs)
        if name == "join" and values:
            sep = values[1] if len(values) > 1 else kwargs.get("d", "")
            return _follow("join filter", values, made, joined=(sep, values[0]))
        return _follow(f"{name} filter", values, made, strict=name not in BUILDING_FILTERS)
    return followed


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > BUILT_LIMIT:
                _refuse(f"repeats a {type(seq).__name__} of {len(seq)} items {_say(n)} times")
        if _is_int(left) and _is_int(right) and left.bit_length() + right.bit_length() > INT_BITS:
            _refuse("multiplies integers past its bits")
    elif operator == "**":
        if _is_int(left) and _is_int(right) and abs(left) > 1 and left.bit_length() * max(right, 0) > INT_BITS:
            _refuse(f"raises an integer of {left.bit_length()} bits to the power {_say(right)}")
    elif isinstance(left, str):  # '%' formatting: a width or precision, written or given by '*'
        values = list(right) if isinstance(right, tuple) else [right]
        for m in _PERCENT.finditer(left):
            for size in m.groups():
                n = values.pop(0) if size == "*" and values else size
                _check_size(n, "a % width or precision")


def _check_method(name: str, owner: str, args: tuple, kwargs: dict) -> None:
    if name in PADDING_METHODS:
        for a in (*args, *kwargs.values()):
            _check_size(a, f"str.{name}")
    elif name in ("format", "format_map"):
        _check_format(owner, [*args, *kwargs.values()])
    elif name == "replace" and len(args) >= 2 and isinstance(args[0], str) and isinstance(args[1], str):
        grown = owner.count(args[0]) * (len(args[1]) - len(args[0])) if args[0] else len(owner) * len(args[1])
        if len(owner) + grown > BUILT_LIMIT:
            _refuse(f"replaces into a string of {len(owner) + grown} characters")


def _check_format(text: str, values: list) -> None:
    """str.format's fields: a width or precision written in the spec, or a nested field's value."""
    try:
        fields = list(string.Formatter().parse(text))
    except ValueError:  # not a format string str.format would take: it raises itself
        return
    for _, _, spec, _ in fields:
        if not spec:
            continue
        if "{" in spec:  # nested: the sizes are arguments
            for v in values:
                _check_size(v, "a format width")
            continue
        m = _SPEC_WIDTH.match(spec)
        for size in (m.groups() if m else ()):
            _check_size(size, "a format width or precision")


def _check_size(n, what: str) -> None:
    if isinstance(n, str):  # a size written in a format string, or given as one
        n = int(n) if n.isdigit() and len(n) < 20 else (BUILT_LIMIT + 1 if n.isdigit() else 0)
    if _is_int(n) and abs(n) > BUILT_LIMIT:
        _refuse(f"asks {what} of {_say(n)}")


def _bounded_filter(name: str, f):
    """A padding filter (PADDING_FILTERS) with its size arguments bounded, `format` with its format string checked,
    `replace` with its growth bounded; Jinja's markers on the filter (pass_context, ...) are kept by wraps."""
    if name not in PADDING_FILTERS | {"format", "replace"}:
        return f

    @functools.wraps(f)
    def bounded(*args, **kwargs):
        values = [a for a in args if not _is_context(a)]
        if name == "format" and values and isinstance(values[0], str):
            _check_binop("%", values[0], tuple(values[1:]))
        elif name == "replace" and len(values) >= 3 and all(isinstance(v, str) for v in values[:3]):
            _check_method("replace", values[0], tuple(values[1:3]), {})
        elif name in PADDING_FILTERS:
            for a in (*values[1:], *kwargs.values()):
                _check_size(a, f"the {name} filter")
        return f(*args, **kwargs)
    return bounded


def _is_context(a) -> bool:
    """Jinja's context, environment or eval context, which a filter marked so receives first."""
    from jinja2 import Environment
    from jinja2.nodes import EvalContext
    from jinja2.runtime import Context

    return isinstance(a, (Context, EvalContext, Environment))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _say(n: int) -> str:
    return str(n) if not _is_int(n) or n.bit_length() < 64 else f"an integer of {n.bit_length()} bits"


def _refuse(what: str):
    raise TemplateLimitError(f"the chat template {what}, past what one step may build ({BUILT_LIMIT} items)")
