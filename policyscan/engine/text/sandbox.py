"""The Jinja sandbox chat templates render in: Jinja's immutable sandbox, and a bound on what one template step may
build, so that a template cannot take a run's memory (the render's time limit cannot stop one allocation:
chat_template._time_limit).

Refused, as a render error of that row: repeating a string or list past BUILT_LIMIT items (`'x' * 10**9`), an
integer product or power past INT_BITS bits, padding past BUILT_LIMIT (`'x'.ljust(10**9)`, `center`, `indent`, a
`%` or `format` width or precision), and a replace that would grow a string past it. Real chat templates do none
of these; numbers in the data (a timestamp passed to `format`) are no sizes and pass.

Steps are also followed as engine/text/follow.py says, so that no step makes a control token out of a message's
text."""
from __future__ import annotations

import functools
import json
import re
import string

from policyscan.engine.text.follow import ContentControlError, followed_filter, joined, method, printed, transformed

BUILT_LIMIT = 1 << 24  # items one step may build: far past any conversation's rendering
INT_BITS = 1 << 16  # bits of an integer a product or power may make
# the str methods and filters whose integer arguments are sizes of what they build
PADDING_METHODS = frozenset({"ljust", "rjust", "center", "zfill", "expandtabs"})
PADDING_FILTERS = frozenset({"center", "indent", "wordwrap", "truncate", "batch", "slice"})
_PERCENT = re.compile(r"%(?:\([^)]*\))?[-+ #0]*(\*|\d+)?(?:\.(\*|\d+))?[hlL]?[a-zA-Z%]")
_SPEC_WIDTH = re.compile(r"^(?:.?[<>=^])?[-+ ]?#?0?(\d+)?[,_]?(?:\.(\d+))?")


class TemplateLimitError(ValueError):
    """A chat template step that would build more than the sandbox allows."""


def sandbox():
    """A new ImmutableSandboxedEnvironment whose steps are bounded and followed as the module says."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Following(CodeGenerator):
        """`~` compiled to the environment's joined_values instead of a bare join (Jinja's own has no hook), but where
        the template escapes its output (no chat template does), which Jinja's join does."""

        def visit_Concat(self, node, frame) -> None:
            if frame.eval_ctx.volatile or frame.eval_ctx.autoescape:
                return super().visit_Concat(node, frame)
            self.write("environment.joined_values((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%", "+"})
        code_generator_class = Following

        def joined_values(self, values: tuple) -> str:
            return joined("'~'", list(values), "".join(map(str, values)))

        def concat(self, pieces) -> str:  # Jinja joins a template's, a macro's or a block's output with it
            parts = list(pieces)
            return joined("output", parts, "".join(parts))

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            made = super().call_binop(context, operator, left, right)
            if operator == "+":
                return joined("'+'", [left, right], made)
            if operator == "%":
                return transformed("'%'", (left, right), made, strict=False)
            if operator == "*" and isinstance(made, str):
                seq, n = (left, right) if isinstance(left, str) else (right, left)
                return joined("'*'", [seq] * n, made) if 1 < n <= 64 else transformed("'*'", (seq,), made, False)
            return made

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  Jinja's own signature
            fn = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands str.format out wrapped
            owner = getattr(fn, "__self__", None)
            if isinstance(owner, (bytes, bytearray)) or (isinstance(owner, int) and fn.__name__ == "to_bytes"):
                raise ContentControlError(f"{type(owner).__name__}.{fn.__name__}", "makes bytes or text of bytes, "
                                          "where a message's text cannot be followed")
            if not isinstance(owner, str):  # a macro or a global: its own markup is the template's
                return super().call(__context, __obj, *args, **kwargs)
            _check_method(fn.__name__, owner, args, kwargs)
            return method(fn.__name__, owner, args, kwargs,
                          lambda *a, **k: ImmutableSandboxedEnvironment.call(__self, __context, __obj, *a, **k))

    env = Bounded(trim_blocks=True, lstrip_blocks=True, finalize=printed,
                  extensions=["jinja2.ext.loopcontrols", _generation_blocks()])
    env.filters["tojson"] = _tojson
    env.filters = {name: followed_filter(name, _bounded_filter(name, f)) for name, f in env.filters.items()}
    return env


def _generation_blocks():
    """`{% generation %}...{% endgeneration %}`, which transformers' templates use to mark the assistant's tokens
    for training masks: rendered as its body, as transformers renders it."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    return Generation


def _tojson(value, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    """tojson as transformers defines it for chat templates (Jinja's own escapes '<' and '>' for HTML and sorts
    keys), so that a tool call renders as transformers renders it; a message's marks pass through as they are."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


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
    elif operator == "%" and isinstance(left, str):  # formatting: a width or precision, written or given by '*'
        values = list(right) if isinstance(right, tuple) else [right]
        for m in _PERCENT.finditer(left):
            if m.group().endswith("c"):
                _no_characters("'%c'")
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
        if spec and spec.endswith("c"):
            _no_characters("format's 'c'")
        if not spec:
            continue
        if "{" in spec:  # nested: the sizes, and perhaps the conversion, are arguments
            for v in values:
                _check_size(v, "a format width")
                if isinstance(v, str) and v.endswith("c"):
                    _no_characters("format's nested spec")
            continue
        m = _SPEC_WIDTH.match(spec)
        for size in (m.groups() if m else ()):
            _check_size(size, "a format width or precision")


def _no_characters(what: str):
    """A conversion that makes a character of a number, which a message's text may set ('%c' of its length)."""
    raise ContentControlError(what, "makes a character out of a number, which a message's text may set")


def _check_size(n, what: str) -> None:
    if isinstance(n, str):  # a size written in a format string, or given as one
        n = int(n) if n.isdecimal() and len(n) < 20 else (BUILT_LIMIT + 1 if n.isdecimal() else 0)
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
