"""Budgets for chat templates that come with a request (``--trust-request-chat-template``).

The sandbox (``ImmutableSandboxedEnvironment``) keeps a template away from the process, but
not from its time or memory: ``range(100000)`` nested in another loop, or ``'x' * 300000000``,
is allowed Jinja. A request's template is therefore rendered (on a worker thread, by the
caller) in ``BudgetedSandbox`` under a ``RenderBudget``:

- time: a deadline checked at every loop iteration, call, filter, operator and output, so the
  render stops within moments of it and the thread never runs on;
- characters: every string (or sequence) the render builds through an operator, call or filter,
  and every piece it writes, is charged to one budget; whatever would pass it is refused
  *before* it is built (``'x' * n``, ``s.replace``, ``'%9999999d' % 1``, int arguments such as
  widths) or, for results whose size is only known afterwards, right after.

A render over budget raises ``TemplateBudgetError`` (a ``ChatTemplateError`` naming
``chat_template``). The parse tree is rewritten before compiling so that loops and outputs call
the meter through ``environment.*`` attributes, which a template cannot shadow.
"""

from __future__ import annotations

import functools
import re
import time
from collections.abc import Callable, Iterable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import jinja2
import jinja2.sandbox
from jinja2 import nodes
from jinja2.runtime import Context

# NOTE: no chat template needs integers this large; beyond it, one multiplication or power can
# hold the GIL for seconds (2 ** 10 ** 9).
MAX_INT_BITS = 1 << 16
# A width or precision in a %-format or a {}-format spec.
_WIDTH = re.compile(r"(?:%[#0\- +]*|\{[^{}]*:[^{}\d.]*)(\d*)(?:\.(\d+))?")


class TemplateBudgetError(jinja2.TemplateError):
    """The request's template passed its time or size budget (``chat_template``)."""


@dataclass(frozen=True, slots=True)
class RenderBudget:
    seconds: float  # wall time the render may take, compiling included
    max_chars: int  # characters it may build and write, counted over the whole render


class _Meter:
    """One render's spending; lives in ``_METER`` for the render's duration."""

    __slots__ = ("budget", "deadline", "spent")

    def __init__(self, budget: RenderBudget) -> None:
        self.budget = budget
        self.deadline = time.monotonic() + budget.seconds
        self.spent = 0

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise TemplateBudgetError(
                f"The chat template took longer than {self.budget.seconds:g} s to render."
            )

    def room(self) -> int:
        return self.budget.max_chars - self.spent

    def need(self, chars: int) -> None:
        """Refuse, before building it, something of ``chars`` that would pass the budget."""
        if chars > self.room():
            raise TemplateBudgetError(
                f"The chat template built more than {self.budget.max_chars} characters while "
                "rendering (its size budget, derived from the context length)."
            )

    def charge(self, chars: int) -> None:
        """Count ``chars`` built or written; refuse when the budget would be passed."""
        self.need(chars)
        self.spent += chars


_METER: ContextVar[_Meter | None] = ContextVar("trillm_template_meter", default=None)


def render_budgeted(
    template: jinja2.Template, budget: RenderBudget, context: dict[str, Any]
) -> str:
    """``template`` (compiled by ``BudgetedSandbox``) rendered under ``budget``."""
    token = _METER.set(_Meter(budget))
    try:
        return template.render(**context)
    finally:
        _METER.reset(token)


def _meter() -> _Meter:
    meter = _METER.get()
    if meter is None:  # NOTE: a budgeted template is only rendered through render_budgeted
        raise TemplateBudgetError("A budgeted template was rendered without its budget.")
    return meter


def _size(value: Any, limit: int) -> int:
    """Characters ``str(value)`` would hold, at least; counting stops past ``limit``."""
    if isinstance(value, str | bytes):
        return len(value)
    if isinstance(value, int) and not isinstance(value, bool):
        return value.bit_length() // 3
    if isinstance(value, dict):
        value = [*value.keys(), *value.values()]
    if not isinstance(value, list | tuple):
        return 1
    total = len(value)
    for item in value:
        if total > limit:
            break
        total += _size(item, limit - total)
    return total


def _check_ints(meter: _Meter, values: Iterable[Any]) -> None:
    """Integer arguments (widths, counts) larger than the budget would build that much."""
    for v in values:
        if _is_int(v):
            meter.need(abs(v))
        if isinstance(v, tuple | list):
            _check_ints(meter, (x for x in v if isinstance(x, int)))


def _check_format(meter: _Meter, fmt: str) -> None:
    """A width or precision in a format string (``%9999999d``, ``{:9999999}``) builds that
    many characters."""
    for width, precision in _WIDTH.findall(fmt):
        for number in (width, precision):
            if number:
                meter.need(int(number) if len(number) < 19 else meter.room() + 1)


def _check_replace(meter: _Meter, text: Any, old: Any, new: Any) -> None:
    if isinstance(text, str) and isinstance(old, str) and isinstance(new, str):
        grow = len(new) - len(old)
        if grow > 0:
            count = text.count(old) if old else len(text) + 1
            meter.need(len(text) + count * grow)


def _precheck_call(meter: _Meter, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What a call would build, where it can be known before building it."""
    _check_ints(meter, args)
    _check_ints(meter, kwargs.values())
    bound = getattr(func, "__wrapped__", func)  # the sandbox wraps str.format
    owner = getattr(bound, "__self__", None)
    name = getattr(bound, "__name__", "")
    if isinstance(owner, str) and name in ("format", "format_map"):
        _check_format(meter, owner)
    if isinstance(owner, str) and name == "replace" and len(args) >= 2:
        _check_replace(meter, owner, args[0], args[1])


def _budgeted_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    """``func`` with the meter around it. It takes the context (``pass_context``) so Jinja
    never folds it at compile time, and hands on what ``func`` itself asks for."""
    wants = jinja2.utils._PassArg.from_obj(func)

    @jinja2.pass_context
    @functools.wraps(func)
    def filtered(context: Context, value: Any, *args: Any, **kwargs: Any) -> Any:
        meter = _meter()
        meter.tick()
        _check_ints(meter, args)
        _check_ints(meter, kwargs.values())
        if name == "format" and isinstance(value, str):
            _check_format(meter, value)
        if name == "replace" and len(args) >= 2:
            _check_replace(meter, value, args[0], args[1])
        lead: tuple[Any, ...] = ()
        if wants is jinja2.utils._PassArg.context:
            lead = (context,)
        elif wants is jinja2.utils._PassArg.eval_context:
            lead = (context.eval_ctx,)
        elif wants is jinja2.utils._PassArg.environment:
            lead = (context.environment,)
        result = func(*lead, value, *args, **kwargs)
        meter.charge(_size(result, meter.room()))
        return result

    return filtered


class BudgetedSandbox(jinja2.sandbox.ImmutableSandboxedEnvironment):
    """The immutable sandbox, metered: see the module's docstring."""

    intercepted_binops = frozenset({"*", "+", "%", "**", "//"})

    def finish_setup(self) -> None:
        """Meter every filter; call once its filters are all registered."""
        self.filters = {name: _budgeted_filter(name, f) for name, f in self.filters.items()}

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        for loop in tree.find_all(nodes.For):
            loop.iter = self._hook("trillm_loop", _as_expr(loop.iter))
        for concat in tree.find_all(nodes.Concat):  # `a ~ b` builds a string too
            concat.nodes = [self._hook("trillm_piece", n) for n in concat.nodes]
        for out in tree.find_all(nodes.Output):
            out.nodes = [self._hook("trillm_write", _as_expr(n)) for n in out.nodes]
        return tree

    @staticmethod
    def _hook(attribute: str, node: nodes.Expr) -> nodes.Expr:
        return nodes.Call(nodes.EnvironmentAttribute(attribute), [node], [], None, None)

    # The hooks the rewritten tree calls (through ``call`` below, so they tick too).
    def trillm_loop(self, iterable: Any) -> Iterator[Any]:
        meter = _meter()
        for item in iterable:
            meter.tick()
            yield item

    def trillm_piece(self, value: Any) -> Any:
        _meter().charge(_size(value, _meter().room()))
        return value

    def trillm_write(self, value: Any) -> str:
        meter = _meter()
        meter.charge(_size(value, meter.room()))
        return str(value)

    def call(__self, __context: Context, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        meter = _meter()
        meter.tick()
        if getattr(__obj, "__self__", None) is not __self:  # the hooks above check themselves
            _precheck_call(meter, __obj, args, kwargs)
        result = super().call(__context, __obj, *args, **kwargs)
        if isinstance(result, str | list | tuple):
            meter.charge(_size(result, meter.room()))
        return result

    def call_binop(self, context: Context, operator: str, left: Any, right: Any) -> Any:
        meter = _meter()
        meter.tick()
        _precheck_binop(meter, operator, left, right)
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, str | list | tuple):
            meter.charge(_size(result, meter.room()))
        return result


def _as_expr(node: nodes.Node) -> nodes.Expr:
    if isinstance(node, nodes.TemplateData):
        return nodes.Const(node.data)
    assert isinstance(node, nodes.Expr)
    return node


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _precheck_binop(meter: _Meter, operator: str, left: Any, right: Any) -> None:
    """Refuse an operation whose result would pass the budget, before computing it."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if isinstance(seq, str | list | tuple) and _is_int(n) and n > 0:
                meter.need(n)
                meter.need(_size(seq, meter.room() // n + 1) * n)
        if _is_int(left) and _is_int(right):
            _check_bits(meter, left.bit_length() + right.bit_length())
    elif operator == "**" and _is_int(left) and _is_int(right) and abs(left) > 1 and right > 0:
        _check_bits(meter, left.bit_length() * min(right, MAX_INT_BITS + 1))
    elif operator == "+" and isinstance(left, str | list | tuple):
        meter.need(_size(left, meter.room()) + _size(right, meter.room()))
    elif operator == "%" and isinstance(left, str):
        _check_format(meter, left)
        _check_ints(meter, right if isinstance(right, tuple | list) else (right,))


def _check_bits(meter: _Meter, bits: int) -> None:
    if bits > MAX_INT_BITS:
        raise TemplateBudgetError(
            f"The chat template computes an integer of more than {MAX_INT_BITS} bits."
        )
