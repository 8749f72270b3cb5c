"""The Jinja sandbox chat templates render in: Jinja's immutable sandbox, and a bound on what one template
expression may build, so that a template cannot take a run's memory (the render's time limit cannot stop one
allocation: chat_template._time_limit).

Refused, as a render error of that row: repeating a string or list past BUILT_LIMIT items (`'x' * 10**9`), a
power with an exponent past POWER_LIMIT, an integer argument past BUILT_LIMIT to any call or filter
(`'x'.ljust(10**9)`, `center(10**9)`), and a format string with a width or precision of 8 digits or more
(`'%999999999s' % x`, `'{:>999999999}'.format(x)`). Real chat templates do none of these."""
from __future__ import annotations

import functools
import re

BUILT_LIMIT = 1 << 24  # items one expression may build: far past any conversation's rendering
POWER_LIMIT = 4096
_WIDE = re.compile(r"\d{8,}")  # a width or precision of 8 digits or more in a format string


class TemplateLimitError(ValueError):
    """A chat template expression that would build more than the sandbox allows."""


def sandbox():
    """A new ImmutableSandboxedEnvironment whose expressions are bounded as the module says."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "%"})

        def call_binop(self, context, operator, left, right):
            _check_binop(operator, left, right)
            return super().call_binop(context, operator, left, right)

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805  Jinja's own signature
            method = getattr(__obj, "__wrapped__", __obj)  # the sandbox hands str.format out wrapped
            if getattr(method, "__name__", None) in ("format", "format_map") and isinstance(
                    getattr(method, "__self__", None), str):
                _check_format(method.__self__)
            _check_args(args, kwargs)
            return super().call(__context, __obj, *args, **kwargs)

    env = Bounded(trim_blocks=True, lstrip_blocks=True)
    env.filters = {name: _bounded_filter(name, f) for name, f in env.filters.items()}
    return env


def _check_binop(operator: str, left, right) -> None:
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, (str, list, tuple)) and _is_int(n) and len(seq) * n > BUILT_LIMIT:
                raise TemplateLimitError(f"the chat template repeats a {type(seq).__name__} of {len(seq)} items "
                                         f"{n} times, past the {BUILT_LIMIT} it may build")
    elif operator == "**":
        if _is_int(right) and right > POWER_LIMIT and not (_is_int(left) and abs(left) <= 1):
            raise TemplateLimitError(f"the chat template raises to the power {right}, past {POWER_LIMIT}")
    elif isinstance(left, str):  # '%' formatting
        _check_format(left)


def _check_args(args: tuple, kwargs: dict) -> None:
    for a in (*args, *kwargs.values()):
        if _is_int(a) and abs(a) > BUILT_LIMIT:
            raise TemplateLimitError(f"the chat template passes {a} to a call, past the {BUILT_LIMIT} it may build")


def _check_format(text: str) -> None:
    if _WIDE.search(text):
        raise TemplateLimitError(f"the chat template formats with {text[:60]!r}, whose width or precision has 8 "
                                 "digits or more")


def _bounded_filter(name: str, f):
    """A filter whose integer arguments (after the value) are bounded, as calls are; `format`'s value is its format
    string, checked as one. Jinja's markers on the filter (pass_context, ...) are kept by functools.wraps."""
    @functools.wraps(f)
    def bounded(*args, **kwargs):
        values = [a for a in args if not _is_context(a)]
        if name == "format" and values and isinstance(values[0], str):
            _check_format(values[0])
        _check_args(tuple(values[1:]), kwargs)
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
