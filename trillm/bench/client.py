"""One streaming request to an OpenAI-compatible server, timed chunk by chunk (httpx on Trio)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import httpx
import orjson

from trillm.bench.metrics import RequestResult

REQUEST_TIMEOUT_S = 6 * 60 * 60  # as vLLM: a benchmark request may legitimately be slow
ERROR_BODY_CHARS = 300


@dataclass(slots=True)
class RequestSpec:
    """What every request of a run shares, besides its prompt."""

    api_url: str  # base_url + endpoint
    model: str
    chat: bool  # /v1/chat/completions (messages) instead of /v1/completions (prompt)
    ignore_eos: bool = False
    sampling: dict[str, Any] | None = None  # temperature, top_p, ... sent as they are


def make_client(max_connections: int | None = None) -> httpx.AsyncClient:
    """One pooled client for the whole run: a connection per in-flight stream, no cap."""
    limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=None)
    timeout = httpx.Timeout(REQUEST_TIMEOUT_S, connect=30.0)
    # NOTE: trust_env=False: a benchmark talks to the server directly, never via a proxy.
    return httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False)


def build_payload(spec: RequestSpec, prompt: str | list[int], max_tokens: int) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": spec.model,
        "stream": True,
        "stream_options": {"include_usage": True},
        **(spec.sampling or {}),
    }
    if spec.chat:
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = max_tokens
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = max_tokens
    if spec.ignore_eos:
        payload["ignore_eos"] = True
    return payload


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or "")


class _StreamState:
    """Folds SSE events into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, chat: bool) -> None:
        self.result = result
        self.chat = chat
        self.last_chunk = 0.0
        self.num_chunks = 0
        self.usage_tokens: int | None = None
        self.texts: list[str] = []

    def feed(self, data: dict[str, Any], now: float) -> None:
        if usage := data.get("usage"):
            self.usage_tokens = usage.get("completion_tokens")
        if "error" in data:
            raise ServerStreamError(str(data["error"]))
        text = "".join(_chunk_text(c, self.chat) for c in data.get("choices") or [])
        if not text:
            return
        if self.num_chunks == 0:
            self.result.ttft = now - self.result.start_time
        else:
            self.result.itl.append(now - self.last_chunk)
        self.last_chunk = now
        self.num_chunks += 1
        self.texts.append(text)


class ServerStreamError(RuntimeError):
    """The server sent an error event inside the stream."""


def _finish(state: _StreamState, tokenizer: Any) -> None:
    r = state.result
    r.generated_text = "".join(state.texts)
    if state.num_chunks == 0:
        r.error = "Never received a chunk with generated text (cannot measure TTFT)."
        return
    if state.usage_tokens is not None:
        r.output_tokens = state.usage_tokens
    elif tokenizer is not None:
        r.output_tokens = len(tokenizer.encode(r.generated_text))
    else:
        r.output_tokens = state.num_chunks
    r.success = True


async def _read_stream(response: httpx.Response, state: _StreamState) -> None:
    async for line in response.aiter_lines():
        if not line.startswith("data:"):
            continue  # blank separators, comments (": ping"), event names
        body = line[5:].strip()
        if body == "[DONE]":
            break
        state.feed(orjson.loads(body), time.perf_counter())


async def send_request(
    client: httpx.AsyncClient,
    spec: RequestSpec,
    prompt: str | list[int],
    prompt_len: int,
    max_tokens: int,
    tokenizer: Any = None,
) -> RequestResult:
    """Stream one request; failures land in ``result.error``, never raise (except cancel)."""
    result = RequestResult(prompt_len=prompt_len)
    state = _StreamState(result, spec.chat)
    payload = build_payload(spec, prompt, max_tokens)
    result.start_time = time.perf_counter()
    try:
        async with client.stream("POST", spec.api_url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:ERROR_BODY_CHARS]}"
                return result
            await _read_stream(response, state)
            result.latency = time.perf_counter() - result.start_time
        _finish(state, tokenizer)
    except (httpx.HTTPError, orjson.JSONDecodeError, ServerStreamError, OSError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result
