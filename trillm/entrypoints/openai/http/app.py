"""The quart-trio app of the OpenAI-compatible server: the request gate (API key, draining, a
dead engine, a full queue), JSON errors, the routes and the JSON / SSE bodies they answer with.
The process around it (the root nursery, the engine, the drain) is ``api_server``."""

from __future__ import annotations

import logging
from typing import Any

from quart import Response, request
from quart_trio import QuartTrio
from werkzeug.exceptions import HTTPException

import trillm
from trillm import envs
from trillm.entrypoints.openai.endpoints import dev_mode, extra_routes, lora
from trillm.entrypoints.openai.endpoints.admission import check_capacity
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.classify import create_classification
from trillm.entrypoints.openai.endpoints.embedding import create_embedding
from trillm.entrypoints.openai.endpoints.score import create_rerank, create_score
from trillm.entrypoints.openai.endpoints.tokenization import detokenize, tokenize
from trillm.entrypoints.openai.endpoints.tokenizer_info import tokenizer_info
from trillm.entrypoints.openai.http.auth import ApiKeys
from trillm.entrypoints.openai.http.bodies import json_body, json_response
from trillm.entrypoints.openai.http.errors import (
    APIError,
    AuthenticationError,
    BadRequestError,
    InternalServerError,
    MethodNotAllowedError,
    NotFoundError,
    PayloadTooLargeError,
    ServiceUnavailableError,
    anthropic_error_body,
    error_body,
    internal_error,
    is_anthropic_route,
)
from trillm.entrypoints.openai.http.exchange import CloseAtExchangeEnd
from trillm.entrypoints.openai.http.health_defaults import DEFAULT_HEALTH_STEP_TIMEOUT_S
from trillm.entrypoints.openai.metrics.prometheus import CONTENT_TYPE as METRICS_CONTENT_TYPE
from trillm.entrypoints.openai.schemas import openapi
from trillm.entrypoints.openai.schemas.pooling import (
    ClassificationRequest,
    EmbeddingRequest,
    PoolingRequest,
)
from trillm.entrypoints.openai.schemas.protocol import DetokenizeRequest, TokenizeRequest
from trillm.entrypoints.openai.schemas.score import RerankRequest, ScoreRequest
from trillm.entrypoints.openai.schemas.structuring import structure_body

logger = logging.getLogger("trillm.server")

MAX_BODY_BYTES = 16 * 1024 * 1024
RETRY_AFTER_S = 1  # the Retry-After of a 503
# Answered whatever the engine's state (draining, dead, full); the API key is auth.py's rule.
_ENGINE_FREE_PATHS = ("/health", "/ping", "/load", "/metrics", "/version", "/openapi.json")


def build_app(
    state: ServerState,
    api_keys: ApiKeys | None = None,
    log_requests_max_len: int | None = None,
    health_step_timeout: float | None = DEFAULT_HEALTH_STEP_TIMEOUT_S,
) -> QuartTrio:
    """``log_requests_max_len``: --enable-log-requests with --max-log-len (None: no log);
    ``health_step_timeout``: --health-step-timeout (None: /health ignores step times)."""
    # No static route: quart mounts /static/<path> over the package's "static" folder by
    # default, a door to files that this server does not serve (vLLM has none).
    app = QuartTrio("trillm", static_folder=None)
    app.config.update(
        MAX_CONTENT_LENGTH=MAX_BODY_BYTES,
        RESPONSE_TIMEOUT=None,  # streams last as long as generation does
        BODY_TIMEOUT=60,
        PROVIDE_AUTOMATIC_OPTIONS=False,
    )
    _install_gate(app, state, api_keys or ApiKeys())
    _install_error_handlers(app)
    log = None if log_requests_max_len is None else extra_routes.RequestLog(log_requests_max_len)
    health = _health_route(state, health_step_timeout)
    _install_routes(app, state, extra_routes.Dispatcher(state, log), health)
    # What a stream whose body never ran holds is released when its exchange ends.
    app.asgi_app = CloseAtExchangeEnd(app.asgi_app)  # type: ignore[method-assign,assignment]
    return app


def _install_gate(app: QuartTrio, state: ServerState, api_keys: ApiKeys) -> None:
    @app.before_request
    async def gate() -> None:
        # NOTE: quart runs this before routing fails, so an unknown path needs the key too.
        path = request.path
        if api_keys.needs_key(path):
            authorization = request.headers.get("Authorization", "").encode()
            # Anthropic's clients send the key as x-api-key; vLLM's routes take Bearer only.
            x_api_key = request.headers.get("x-api-key", "") if is_anthropic_route(path) else ""
            if not api_keys.admits(authorization, x_api_key.encode()):
                raise AuthenticationError("Invalid or missing API key.")
        if path in _ENGINE_FREE_PATHS:
            return
        if state.draining:
            raise ServiceUnavailableError("The server is shutting down.")
        if state.engine.is_dead:
            raise ServiceUnavailableError(f"The engine is not available: {state.engine.dead_error}")
        if request.method == "POST" and path.startswith("/v1/"):
            # A full queue refuses before the body is read; start_generation checks again
            # with the request's real size (prompts x n).
            check_capacity(state)

    @app.after_request
    async def retry_after(response: Response) -> Response:
        # NOTE: every 503 here is transient (overload, shutdown, an engine being replaced):
        # tell clients and load balancers when to come back.
        if response.status_code == 503 and "Retry-After" not in response.headers:
            response.headers["Retry-After"] = str(RETRY_AFTER_S)
        return response


def _install_error_handlers(app: QuartTrio) -> None:
    @app.errorhandler(APIError)
    async def api_error(err: APIError) -> Response:
        return _error_response(err.body(), err.status)

    @app.errorhandler(HTTPException)
    async def http_error(err: HTTPException) -> Response:
        code = err.code or 500
        kind = {404: NotFoundError, 405: MethodNotAllowedError, 413: PayloadTooLargeError}.get(
            code, BadRequestError if 400 <= code < 500 else InternalServerError
        )
        message = {
            404: f"No route {request.path}.",
            413: f"The request body is larger than {MAX_BODY_BYTES} bytes.",
        }.get(code, err.description or err.name)
        return _error_response(error_body(message, kind.type, None, code), code)

    @app.errorhandler(Exception)
    async def unhandled(err: Exception) -> Response:
        logger.error("Unhandled error in %s %s", request.method, request.path)
        api_error = internal_error(err)
        return _error_response(api_error.body(), api_error.status)


def _error_response(body: dict[str, Any], status: int) -> Response:
    """An error in OpenAI's shape, or in Anthropic's on Anthropic's routes."""
    if is_anthropic_route(request.path):
        body = anthropic_error_body(body["error"]["message"], status)
    return json_response(body, status)


def _health_route(state: ServerState, step_timeout: float | None) -> Any:
    """``GET /health``: 200 while the engine serves; 503 while it starts, drains or is dead,
    and while one of its steps has run past ``step_timeout`` (a worker stopped or hung: the
    executor's own step timeout, 300 s, would end it much later)."""
    stalled = False  # logged once per stall

    async def health() -> Response:
        nonlocal stalled
        engine = state.engine
        if state.draining or engine.is_dead or not engine.is_running:
            err = ServiceUnavailableError("The server is not ready or shutting down.")
            return json_response(err.body(), err.status)
        running_s, core = (0.0, 0) if step_timeout is None else engine.longest_running_step()
        if step_timeout is not None and running_s > step_timeout:
            message = (
                f"The engine has not finished a step in {running_s:.0f} s (engine core "
                f"{core}; --health-step-timeout {step_timeout:g} s)."
            )
            if not stalled:
                logger.warning("%s", message)
            stalled = True
            err = ServiceUnavailableError(message)
            return json_response(err.body(), err.status)
        if stalled:
            logger.info("The engine finished its step: /health answers 200 again.")
        stalled = False
        return Response(b"", 200)

    return health


def _install_routes(
    app: QuartTrio, state: ServerState, run: extra_routes.Dispatcher, health: Any
) -> None:
    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return await run.chat(await json_body())

    @app.post("/v1/chat/completions/batch")
    async def chat_batch() -> Response:
        return await run.chat_batch(await json_body())

    @app.post("/v1/completions")
    async def completions() -> Response:
        return await run.completion(await json_body())

    @app.get("/v1/models")
    async def models() -> Response:
        cards = model_cards(state)
        if state.loras is not None:
            cards += state.loras.cards()
        return json_response({"object": "list", "data": cards})

    if state.loras is not None and state.loras.allow_updates:
        loras = state.loras

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter() -> Response:
            text = await lora.load_adapter(loras, state.engine, await json_body())
            return Response(text, 200, content_type="text/plain")

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter() -> Response:
            text = lora.unload_adapter(loras, state.engine, await json_body())
            return Response(text, 200, content_type="text/plain")

    @app.post("/v1/embeddings")
    async def embeddings() -> Response:
        body = await json_body()
        req = await structure_body(EmbeddingRequest, body, request.content_length)
        return json_response(await create_embedding(state, req))

    @app.post("/pooling")
    async def pooling() -> Response:
        body = await json_body()
        req = await structure_body(PoolingRequest, body, request.content_length)
        return json_response(await create_embedding(state, req))

    @app.post("/classify")
    async def classify() -> Response:
        body = await json_body()
        req = await structure_body(ClassificationRequest, body, request.content_length)
        return json_response(await create_classification(state, req))

    @app.post("/score")
    @app.post("/v1/score")
    async def score() -> Response:
        body = await json_body()
        req = await structure_body(ScoreRequest, body, request.content_length)
        return json_response(await create_score(state, req))

    @app.post("/rerank")
    @app.post("/v1/rerank")
    @app.post("/v2/rerank")
    async def rerank() -> Response:
        body = await json_body()
        req = await structure_body(RerankRequest, body, request.content_length)
        return json_response(await create_rerank(state, req))

    @app.post("/tokenize")
    async def tokenize_route() -> Response:
        body = await json_body()
        req = await structure_body(TokenizeRequest, body, request.content_length)
        return json_response(await tokenize(state, req))

    if state.enable_tokenizer_info_endpoint:  # vLLM's: no route without the flag

        @app.get("/tokenizer_info")
        async def tokenizer_info_route() -> Response:
            return json_response(tokenizer_info(state))

    @app.post("/detokenize")
    async def detokenize_route() -> Response:
        body = await json_body()
        req = await structure_body(DetokenizeRequest, body, request.content_length)
        return json_response(await detokenize(state, req))

    if envs.SERVER_DEV_MODE.get():  # vLLM's: these routes do not exist without it
        dev_mode.install(app, state)

    app.get("/health")(health)
    # SageMaker's health check: the same answer as /health.
    app.route("/ping", methods=["GET", "POST"])(health)

    extra_routes.install(app, run)  # /invocations, /load, /v1/responses, /v1/messages

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": trillm.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), 200, content_type=METRICS_CONTENT_TYPE)

    @app.get("/openapi.json")
    async def openapi_json() -> Response:
        return json_response(openapi.build_spec())


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    cfg = state.model_config
    return [
        {
            "id": name,
            "object": "model",
            "created": 0,
            "owned_by": "trillm",
            "root": cfg.model,
            "parent": None,
            "max_model_len": cfg.max_model_len,
        }
        for name in state.served_model_names
    ]
