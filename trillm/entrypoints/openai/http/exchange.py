"""Clean-up that must run when an HTTP exchange ends, in any way, never left to the garbage
collector: an ASGI wrapper around the app (``CloseAtExchangeEnd``) gives each exchange a list
of callbacks (``exchange_cleanups.at_exchange_end``) and runs them, shielded, when the app's
call returns.

Why: a streamed response's body is an async generator that quart iterates (and closes) only
once the response starts. A client gone before that (or a server shutting down) leaves the
body never iterated, so its ``finally`` never runs; what it would have released (the engine
request, the admission, the ``/load`` count) is released here. The callbacks must be
idempotent: after a body that ran, they find nothing left to do.
"""

from __future__ import annotations

import logging
from typing import Any

import trio

from trillm.entrypoints.openai.http.exchange_cleanups import Cleanup, collecting_into

logger = logging.getLogger(__name__)


class CloseAtExchangeEnd:
    """ASGI wrapper: runs each HTTP exchange's ``at_exchange_end`` callbacks when it ends."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cleanups: list[Cleanup] = []
        try:
            with collecting_into(cleanups):
                await self.app(scope, receive, send)
        finally:
            with trio.CancelScope(shield=True):
                for cleanup in cleanups:
                    try:
                        await cleanup()
                    except Exception:  # one failed clean-up never skips the others
                        logger.exception("clean-up at the end of an HTTP exchange failed")
