"""vLLM's deployment endpoints, /v1/responses and the per-request log.

- ``/invocations`` (POST): SageMaker's one inference route: a body with ``messages`` is a chat
  completion, one with ``prompt`` a completion (vLLM's rule), anything else a 400;
- ``/v1/responses`` (POST): OpenAI's Responses API (``serving_responses.py``); GET
  ``/v1/responses/{id}`` and POST ``/v1/responses/{id}/cancel``: the store's
  (``responses_store.py``, with VLLM_ENABLE_RESPONSES_API_STORE=1; else each is vLLM's 404);
- ``/v1/messages`` and ``/v1/messages/count_tokens`` (POST): Anthropic's Messages API
  (``anthropic_messages.py``);
- ``/load`` (GET): ``{"server_load": N}``, the generation requests in flight, a stream until
  its last byte (vLLM's load endpoint);
- ``--enable-log-requests``: a line when a generation request is accepted (prompt or
  messages truncated to ``--max-log-len`` characters, sampling fields) and one when it ends.
  Off by default: prompts are never logged unless asked.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import orjson
from quart import request

from trillm.entrypoints.openai.endpoints.anthropic_messages import count_tokens, create_message
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.chat import create_chat_completion
from trillm.entrypoints.openai.endpoints.chat_batch import (
    batch_requests,
    create_batch_chat_completion,
)
from trillm.entrypoints.openai.endpoints.completion import create_completion
from trillm.entrypoints.openai.endpoints.orca import add_load_report
from trillm.entrypoints.openai.endpoints.responses import create_response
from trillm.entrypoints.openai.endpoints.responses_background import cancel
from trillm.entrypoints.openai.endpoints.responses_store import not_found
from trillm.entrypoints.openai.http.bodies import json_body, json_response, result_response
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.http.exchange_cleanups import at_exchange_end
from trillm.entrypoints.openai.schemas.anthropic import parse_count_tokens, parse_messages
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest, CompletionRequest
from trillm.entrypoints.openai.schemas.responses import parse_request
from trillm.entrypoints.openai.schemas.structuring import structure_body
from trillm.model_executor.encoder_config import is_encoder

logger = logging.getLogger("trillm.requests")

# Body fields a request log line leaves out: the prompt itself (shown truncated apart) and
# the bulky structures (only their size is shown).
_PROMPT_FIELDS = ("prompt", "messages", "input", "instructions", "system")
_BULKY_FIELDS = (
    "tools",
    "response_format",
    "structured_outputs",
    "logit_bias",
    "chat_template",
    "documents",
)


# The sampling fields are logged up to this many characters even with a short --max-log-len
# (which is about the prompt, the private part).
PARAMS_LOG_LEN = 1024


class RequestLog:
    """``--enable-log-requests``: one line per accepted request, one when it ends."""

    def __init__(self, max_len: int) -> None:
        self.max_len = max_len
        self.ids = itertools.count(1)

    def truncate(self, text: str, limit: int | None = None) -> str:
        limit = self.max_len if limit is None else limit
        if len(text) <= limit:
            return text
        return f"{text[:limit]}... ({len(text)} characters)"

    def received(self, kind: str, body: dict[str, Any]) -> int:
        number = next(self.ids)
        prompt = body.get("messages", body.get("prompt", body.get("input")))
        shown = prompt if isinstance(prompt, str) else orjson.dumps(prompt).decode()
        params = {k: v for k, v in body.items() if k not in _PROMPT_FIELDS + _BULKY_FIELDS}
        for name in _BULKY_FIELDS:
            if name in body:
                params[name] = f"<{len(orjson.dumps(body[name]))} bytes>"
        logger.info(
            "Received request #%d (%s): prompt: %r, params: %s",
            number,
            kind,
            self.truncate(shown),
            self.truncate(orjson.dumps(params).decode(), max(self.max_len, PARAMS_LOG_LEN)),
        )
        return number

    def finished(self, number: int, result: Any, start: float) -> None:
        elapsed = time.perf_counter() - start
        if isinstance(result, dict):
            reasons = [c.get("finish_reason") for c in result.get("choices", [])] or [
                result.get("status", result.get("stop_reason"))  # /v1/responses, /v1/messages
            ]
            logger.info(
                "Finished request #%d %s: finish_reason %s, usage %s, %.3f s",
                number,
                result.get("id"),
                reasons,
                result.get("usage"),
                elapsed,
            )
        else:
            logger.info("Finished request #%d: stream ended after %.3f s", number, elapsed)

    def failed(self, number: int, exc: BaseException) -> None:
        logger.info("Request #%d refused or failed: %s: %s", number, type(exc).__name__, exc)


class Dispatcher:
    """Runs the chat / completion handlers for the routes, with the request log and the
    server load around them."""

    def __init__(self, state: ServerState, log: RequestLog | None) -> None:
        self.state = state
        self.log = log
        # Generation requests in flight, streams until their last byte: /load (vLLM's
        # server_load_metrics).
        self.load = 0

    async def chat(self, body: dict[str, Any]) -> Any:
        req = await structure_body(ChatCompletionRequest, body, request.content_length)
        answer = await self._run("chat", body, create_chat_completion(self.state, req))
        return add_load_report(self.state, answer)

    async def chat_batch(self, body: dict[str, Any]) -> Any:
        reqs = await batch_requests(self.state, body, request.content_length)
        return await self._run("chat", body, create_batch_chat_completion(self.state, reqs))

    async def completion(self, body: dict[str, Any]) -> Any:
        req = await structure_body(CompletionRequest, body, request.content_length)
        answer = await self._run("completion", body, create_completion(self.state, req))
        return add_load_report(self.state, answer)

    async def responses(self, body: dict[str, Any]) -> Any:
        req = await parse_request(body, request.content_length)
        return await self._run("responses", body, create_response(self.state, req))

    async def messages(self, body: dict[str, Any]) -> Any:
        req = await parse_messages(body, request.content_length)
        return await self._run("messages", body, create_message(self.state, req))

    async def invocation(self, body: dict[str, Any]) -> Any:
        """SageMaker's /invocations: the body's shape picks the API, as vLLM does."""
        if "messages" in body:
            return await self.chat(body)
        if "prompt" in body:
            return await self.completion(body)
        raise BadRequestError(
            "An /invocations body must be a chat completion request (with 'messages') or a "
            "completion request (with 'prompt')."
        )

    async def _run(self, kind: str, body: dict[str, Any], work: Awaitable[Any]) -> Any:
        config = self.state.engine.config
        pooler = config.pooler
        if pooler is not None:
            encoder = is_encoder(config.model.architecture)
            routes = "/classify" if pooler.task == "classify" else "/v1/embeddings, /pooling"
            if encoder or pooler.task == "embed":
                routes += ", /score, /rerank"
            hint = (
                f"{config.model.architecture} is an encoder-only model: it cannot generate"
                if encoder
                else "start it without --runner pooling to generate"
            )
            raise BadRequestError(
                f"This server runs a pooling model (task {pooler.task!r}): it serves {routes}, "
                f"not {kind} requests ({hint}).",
                "model",
            )
        number, start = (
            (self.log.received(kind, body), time.perf_counter()) if self.log else (0, 0.0)
        )
        self.load += 1
        try:
            result = await work
        except BaseException as exc:
            self.load -= 1
            if self.log:
                self.log.failed(number, exc)
            raise
        if isinstance(result, dict):
            self.load -= 1
            if self.log is not None:
                self.log.finished(number, result, start)
            return result_response(result)
        return result_response(self._tracked_stream(result, number, start))

    def _tracked_stream(
        self, stream: AsyncIterator[bytes], number: int, start: float
    ) -> AsyncIterator[bytes]:
        """The stream, counted in ``load`` until it ends (read to the end, the client gone,
        or never started: then when the HTTP exchange ends), logged at its end with the
        request log."""
        ended = False

        def end() -> None:
            nonlocal ended
            if not ended:
                ended = True
                self.load -= 1
                if self.log is not None:
                    self.log.finished(number, None, start)

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in stream:
                    yield chunk
            finally:
                end()
                await stream.aclose()  # type: ignore[attr-defined]

        async def end_unless_ended() -> None:  # a response body never iterated
            end()

        at_exchange_end(end_unless_ended)
        return body()


def install(app: Any, dispatcher: Dispatcher) -> None:
    """/invocations, /load, /v1/responses and /v1/messages on ``app``."""

    @app.post("/v1/responses")
    async def responses() -> Any:
        return await dispatcher.responses(await json_body())

    @app.get("/v1/responses/<response_id>")
    async def get_response(response_id: str) -> Any:
        store = dispatcher.state.responses_store
        if request.args.get("stream", "false").lower() not in ("false", "0", ""):
            raise BadRequestError(
                "'stream' replays a background response's events; background responses are "
                "not implemented, so a stored response is returned whole (stream=false).",
                "stream",
            )
        if store is None:
            raise not_found(response_id)  # (VLLM_ENABLE_RESPONSES_API_STORE is off)
        return json_response(store.get(response_id).response)

    @app.post("/v1/responses/<response_id>/cancel")
    async def cancel_response(response_id: str) -> Any:
        return json_response(cancel(dispatcher.state.responses_store, response_id))

    @app.post("/v1/messages")
    async def messages() -> Any:
        return await dispatcher.messages(await json_body())

    @app.post("/v1/messages/count_tokens")
    async def count_message_tokens() -> Any:
        req = await parse_count_tokens(await json_body(), request.content_length)
        return json_response(await count_tokens(dispatcher.state, req))

    @app.post("/invocations")
    async def invocations() -> Any:
        return await dispatcher.invocation(await json_body())

    @app.get("/load")
    async def load() -> Any:
        return json_response({"server_load": dispatcher.load})
