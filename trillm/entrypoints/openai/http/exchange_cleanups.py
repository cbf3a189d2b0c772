"""The clean-ups of the current HTTP exchange: ``at_exchange_end`` registers one, and
``CloseAtExchangeEnd`` (``exchange.py``, the ASGI wrapper above the app) runs them when the
exchange ends. Apart from the wrapper so that a handler deep in a route registers by calling
down into this module, never back into the wrapper that called it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

Cleanup = Callable[[], Awaitable[None]]

# The current exchange's callbacks; the handler's tasks inherit the list (context copies).
_CLEANUPS: ContextVar[list[Cleanup] | None] = ContextVar("trillm_exchange_cleanups", default=None)


def at_exchange_end(cleanup: Cleanup) -> None:
    """Run ``cleanup()`` when the current HTTP exchange ends."""
    cleanups = _CLEANUPS.get()
    if cleanups is None:
        raise RuntimeError("at_exchange_end needs the CloseAtExchangeEnd ASGI wrapper.")
    cleanups.append(cleanup)


@contextmanager
def collecting_into(cleanups: list[Cleanup]) -> Iterator[None]:
    """Inside the block (and the tasks it starts), ``at_exchange_end`` appends to
    ``cleanups``."""
    token = _CLEANUPS.set(cleanups)
    try:
        yield
    finally:
        _CLEANUPS.reset(token)
