"""vLLM's development routes, served only with ``VLLM_SERVER_DEV_MODE=1`` (404 otherwise, as
in vLLM); the API key guards them as any other route (``http/auth.py``).

    POST /sleep?level=1|2&mode=abort|keep|wait
    POST /wake_up[?tags=weights&tags=kv_cache]
    GET  /is_sleeping -> {"is_sleeping": bool}
    POST /reset_prefix_cache[?reset_running_requests=true]
    POST /pause?mode=abort|keep|wait&clear_cache=true|false
    POST /resume
    GET  /is_paused -> {"is_paused": bool}
    POST /collective_rpc {"method", "args", "kwargs", "timeout"} -> {"results": [...]}

Each is the engine's call of the same name (``trillm/engine/engine_control.py``); what it
refuses (sleep mode off, a level, mode or tag it does not know, a method the workers lack) is a
400 naming it, and so is a query parameter the route does not take. Generation requests sent
while the engine sleeps or is paused wait for it (bounded by their own timeouts).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

from quart import Response, request

from trillm.engine.core_control import PauseMode
from trillm.entrypoints.openai.http.bodies import json_body, json_response
from trillm.entrypoints.openai.http.errors import APIError, BadRequestError

if TYPE_CHECKING:
    from quart_trio import QuartTrio

    from trillm.engine.async_engine import AsyncEngine
    from trillm.entrypoints.openai.endpoints.base import ServerState

_TRUE, _FALSE = ("1", "true"), ("0", "false")


class GatewayTimeoutError(APIError):
    status = 504
    type = "timeout_error"


def install(app: QuartTrio, state: ServerState) -> None:
    """The development routes on ``app`` (call only in dev mode)."""

    def engine() -> AsyncEngine:
        return state.engine

    @app.post("/sleep")
    async def sleep() -> Response:
        args = _query({"level", "mode"})
        level = _integer(args.get("level", "1"), "level")
        mode = cast(PauseMode, args.get("mode", "abort"))  # checked by the engine
        await _refusing(engine().sleep(level, mode))
        return Response("", 200)

    @app.post("/wake_up")
    async def wake_up() -> Response:
        _query({"tags"})
        tags = request.args.getlist("tags") or None
        await _refusing(engine().wake_up(tags))
        return Response("", 200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> Response:
        return json_response({"is_sleeping": await engine().is_sleeping()})

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        args = _query({"reset_running_requests"})
        running = _boolean(args.get("reset_running_requests", "false"), "reset_running_requests")
        await engine().reset_prefix_cache(running)
        return Response("", 200)

    @app.post("/pause")
    async def pause() -> Response:
        args = _query({"mode", "clear_cache"})
        clear = _boolean(args.get("clear_cache", "true"), "clear_cache")
        mode = cast(PauseMode, args.get("mode", "abort"))  # checked by the engine
        await _refusing(engine().pause_generation(mode=mode, clear_cache=clear))
        return Response("", 200)

    @app.post("/resume")
    async def resume() -> Response:
        _query(set())
        await engine().resume_generation()
        return Response("", 200)

    @app.get("/is_paused")
    async def is_paused() -> Response:
        return json_response({"is_paused": await engine().is_paused()})

    @app.post("/collective_rpc")
    async def collective_rpc() -> Response:
        method, timeout, args, kwargs = _rpc_fields(await json_body())
        try:
            results = await _refusing(engine().collective_rpc(method, timeout, args, kwargs))
        except TimeoutError as exc:
            raise GatewayTimeoutError(str(exc), "timeout") from None
        return json_response({"results": results})


async def _refusing(call: Any) -> Any:
    """The engine's refusal (a ValueError or TypeError naming what it refused) as a 400."""
    try:
        return await call
    except (ValueError, TypeError) as exc:
        raise BadRequestError(str(exc)) from None


def _query(allowed: set[str]) -> dict[str, str]:
    unknown = sorted(set(request.args) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "none"
        raise BadRequestError(
            f"{request.path} takes no query parameter {unknown[0]!r} (it takes: {takes}).",
            unknown[0],
        )
    return {key: request.args[key] for key in request.args}


def _integer(text: str, name: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise BadRequestError(f"{name}={text!r}: expected an integer.", name) from None


def _boolean(text: str, name: str) -> bool:
    value = text.strip().lower()
    if value not in _TRUE + _FALSE:
        raise BadRequestError(f"{name}={text!r}: expected true or false.", name)
    return value in _TRUE


def _rpc_fields(body: Any) -> tuple[str, float | None, list[Any], dict[str, Any]]:
    """vLLM's /collective_rpc body, checked: method (a name), timeout, args, kwargs."""
    if not isinstance(body, dict):
        raise BadRequestError("The body must be a JSON object.")
    unknown = sorted(set(body) - {"method", "timeout", "args", "kwargs"})
    if unknown:
        raise BadRequestError(f"/collective_rpc takes no field {unknown[0]!r}.", unknown[0])
    method = body.get("method")
    if not isinstance(method, str) or not method:
        raise BadRequestError(
            "Missing 'method' in request body (a worker method's name).", "method"
        )
    timeout = body.get("timeout")
    valid_timeout = isinstance(timeout, int | float) and not isinstance(timeout, bool)
    if timeout is not None and not (valid_timeout and 0 < timeout < float("inf")):
        raise BadRequestError("timeout must be a positive number of seconds.", "timeout")
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list):
        raise BadRequestError("args must be a list.", "args")
    if not isinstance(kwargs, dict):
        raise BadRequestError("kwargs must be an object.", "kwargs")
    return method, timeout, args, kwargs
