"""``background: true`` on /v1/responses (vLLM's, which ties it to the response store): the
request is checked and admitted at once, answered with the stored response in status
``queued``, and run in the server's nursery; once finished the store holds the completed (or
incomplete) response, ``failed`` when it raised. ``POST /v1/responses/{id}/cancel`` cancels a
running one (the engine aborts it; the stored response says ``cancelled``) and is vLLM's 400
for a finished one. Only the whole response: background with ``stream`` (vLLM's event replay,
``GET ...?stream=true``) is refused by name.

A background request holds its admission (``--max-num-seqs`` + ``--max-num-queued-requests``,
the token bound) like any other until it ends, so clients cannot run more of them than the
server admits.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.responses_store import ResponseStore, not_found
from trillm.entrypoints.openai.http.errors import BadRequestError, NotFoundError

logger = logging.getLogger(__name__)

# response id -> the cancel scope of its background run, while it runs
_RUNNING: dict[str, trio.CancelScope] = {}


def check_background(store: ResponseStore | None, stream: bool) -> None:
    if store is None:  # vLLM's refusal, word for word
        raise BadRequestError(
            "This vLLM engine does not support `store=True` and therefore does not support "
            "the background mode. To enable these features, set the environment variable "
            "`VLLM_ENABLE_RESPONSES_API_STORE=1` when launching the vLLM server.",
            "background",
        )
    if stream:
        raise BadRequestError(
            "'background' with 'stream' is not supported (its events are not kept for replay); "
            "ask without 'stream' and read the result with GET /v1/responses/{id}.",
            "background",
        )


def start_background(
    state: ServerState,
    store: ResponseStore,
    queued: dict[str, Any],
    messages: list[Any],
    run: Callable[[], Awaitable[dict[str, Any]]],
) -> dict[str, Any]:
    """Store ``queued`` and run ``run`` (which stores the finished response) in the server's
    nursery; returns ``queued``."""
    store.keep(queued, messages)
    scope = trio.CancelScope()
    _RUNNING[queued["id"]] = scope

    async def background() -> None:
        try:
            with scope:
                await run()
        except Exception:
            logger.exception("background response %s failed", queued["id"])
            _set_status(store, queued["id"], "failed")
        finally:
            _RUNNING.pop(queued["id"], None)

    state.nursery.start_soon(background)
    return queued


def cancel(store: ResponseStore | None, response_id: str) -> dict[str, Any]:
    """vLLM's cancel: 404 when not stored, 400 when it is not running, else the stored
    response, now ``cancelled``."""
    if store is None:
        raise not_found(response_id)
    stored = store.get(response_id)
    scope = _RUNNING.get(response_id)
    if scope is None or stored.response["status"] not in ("queued", "in_progress"):
        raise BadRequestError("Cannot cancel a synchronous response.", "response_id")
    stored.response["status"] = "cancelled"
    scope.cancel()
    return stored.response


def finished_unless_cancelled(store: ResponseStore, messages: list[Any]) -> Callable[..., object]:
    """The store's keep for a background response: a cancelled one stays cancelled."""

    def keep(body: dict[str, Any]) -> object:
        try:
            if store.get(body["id"]).response["status"] == "cancelled":
                return False
        except NotFoundError:  # evicted meanwhile: kept anew
            pass
        return store.keep(body, messages)

    return keep


def _set_status(store: ResponseStore, response_id: str, status: str) -> None:
    try:
        stored = store.get(response_id)
    except NotFoundError:  # evicted meanwhile
        return
    if stored.response["status"] not in ("completed", "incomplete", "cancelled"):
        stored.response["status"] = status
