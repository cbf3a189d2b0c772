"""Request and response bodies: a request's JSON object (400 / 413 / 415 as APIErrors), and
an answer as a JSON response or an SSE stream. Below the app and the routes, which both use
it, so that neither calls back into the other to read or answer a body."""

from __future__ import annotations

import gc
import json
from typing import Any

import orjson
from quart import Response, request

from trillm.entrypoints.openai.http.errors import BadRequestError, UnsupportedMediaTypeError

_SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


async def json_body() -> Any:
    """The request body as decoded JSON (an object), or a 400/413 APIError."""
    mimetype = request.mimetype
    if mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UnsupportedMediaTypeError(
            f"Content-Type must be application/json, got {mimetype or 'none'!r}."
        )
    data = await request.get_data(cache=False)  # 413 (HTTPException) beyond MAX_CONTENT_LENGTH
    try:
        body = parse_json(data)
    except orjson.JSONDecodeError as exc:
        raise BadRequestError(f"The request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise BadRequestError("The request body must be a JSON object.")
    return body


def parse_json(data: bytes | str) -> Any:
    """``orjson.loads`` with the garbage collector paused. A JSON document's values are new
    objects that form no cycle, so a collection has nothing to find among them; yet millions of
    containers (a 15 MB body of 5,000,000 empty lists) set off full collections over and over,
    on the event loop: 5.2 s during which /health and every other request waited, ~1 s of
    it the parse."""
    paused = gc.isenabled()
    gc.disable()
    try:
        return orjson.loads(data)
    finally:
        if paused:
            gc.enable()


def json_response(body: Any, status: int = 200) -> Response:
    return Response(json_bytes(body), status, content_type="application/json")


def json_bytes(body: Any) -> bytes:
    """``body`` as JSON. orjson writes integers only up to 64 bits; beyond that (a tokenizer's
    model_max_length of 10**30, as transformers stores "no limit") Python's json writes any
    integer, as vLLM's answers do."""
    try:
        return orjson.dumps(body)
    except TypeError:
        return json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode()


def result_response(result: Any) -> Response:
    if isinstance(result, dict):
        return json_response(result)
    response = Response(result, 200, content_type="text/event-stream", headers=_SSE_HEADERS)
    response.timeout = None
    return response
