"""The HTTP error shape (OpenAI's) and the mapping from internal failures to status codes.

Every error the server answers has the body
``{"error": {"message": str, "type": str, "param": str | None, "code": int}}``, but on
Anthropic's Messages routes, which answer in Anthropic's shape (``anthropic_error_body``).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

import orjson

logger = logging.getLogger("trillm.server")


class APIError(Exception):
    """An error answered to the client as-is: status code, OpenAI error type, offending param."""

    status: int = 500
    type: str = "InternalServerError"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.status)


class BadRequestError(APIError):
    status = 400
    type = "BadRequestError"


class AuthenticationError(APIError):
    status = 401
    type = "AuthenticationError"


class NotFoundError(APIError):
    status = 404
    type = "NotFoundError"


class MethodNotAllowedError(APIError):
    status = 405
    type = "MethodNotAllowedError"


class PayloadTooLargeError(APIError):
    status = 413
    type = "PayloadTooLargeError"


class UnsupportedMediaTypeError(BadRequestError):
    """A body that is not JSON: OpenAI answers 400 for it, so do we."""


class InternalServerError(APIError):
    status = 500
    type = "InternalServerError"


class ServiceUnavailableError(APIError):
    status = 503
    type = "ServiceUnavailableError"


# The most characters an error's message (and its param) is answered with. Many refusals quote
# the value refused; a 4 MB value quoted whole made a 4 MB answer (three 4 MB logit_bias keys:
# 12 MB), so past this a message is cut, saying how long it was.
MAX_ERROR_MESSAGE_CHARS = 4096
MAX_ERROR_PARAM_CHARS = 256


def error_body(message: str, type_: str, param: str | None, code: int) -> dict[str, Any]:
    message = _clipped(message, MAX_ERROR_MESSAGE_CHARS)
    param = None if param is None else _clipped(param, MAX_ERROR_PARAM_CHARS)
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def _clipped(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters in all)"


# Anthropic's Messages routes answer errors in Anthropic's shape,
# ``{"type": "error", "error": {"type": str, "message": str}}``, its type named by the status.
ANTHROPIC_ROUTE = "/v1/messages"
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}


def is_anthropic_route(path: str) -> bool:
    return path == ANTHROPIC_ROUTE or path.startswith(ANTHROPIC_ROUTE + "/")


def anthropic_error_body(message: str, status: int) -> dict[str, Any]:
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {
        "type": "error",
        "error": {"type": kind, "message": _clipped(message, MAX_ERROR_MESSAGE_CHARS)},
    }


def sse_error_event(error: APIError) -> bytes:
    """An error after a stream has started: an SSE event, the caller then sends [DONE]."""
    return b"data: " + orjson.dumps(error.body()) + b"\n\n"


def from_engine_exception(exc: BaseException) -> APIError:
    """Classify a failure raised by the engine (or by SamplingParams) into an APIError."""
    from trillm.errors import EngineDeadError

    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return ServiceUnavailableError(f"The engine is not available: {exc}")
    if _is_request_too_large(exc):
        return BadRequestError(str(exc), getattr(exc, "param", None) or "max_tokens")
    if isinstance(exc, ValueError) and hasattr(exc, "param"):
        # SamplingParamsError, the input processor's InvalidRequestError: bad input.
        return BadRequestError(str(exc), exc.param)
    return internal_error(exc)


def internal_error(exc: BaseException) -> InternalServerError:
    """A 500 that names no internals: the client gets a reference to quote, the log has the
    traceback under the same reference."""
    reference = uuid.uuid4().hex[:12]
    logger.error("internal error %s: %s: %s", reference, type(exc).__name__, exc, exc_info=exc)
    return InternalServerError(f"Internal server error (reference {reference}).")


def _is_request_too_large(exc: BaseException) -> bool:
    try:
        from trillm.core.errors import RequestTooLargeError
    except ImportError:  # the scheduler's error module is optional for the frontend
        return False
    return isinstance(exc, RequestTooLargeError)
