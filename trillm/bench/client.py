"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

A chunk counts as a token arrival when it carries generated text (``choices[].text`` or
``delta.content``/``reasoning_content``); role-only and empty end chunks do not, so TTFT is
the wait for the first visible token. Output tokens come from the usage chunk
(``stream_options.include_usage``), else from the tokenizer, else from the chunk count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import orjson

from trillm.bench.metrics import RequestResult
from trillm.bench.transport import H11Transport, HttpxTransport, TransportError

ERROR_BODY_CHARS = 300


@dataclass(slots=True)
class RequestSpec:
    """What every request of a run shares, besides its prompt."""

    api_url: str  # base_url + endpoint
    model: str
    chat: bool  # /v1/chat/completions (messages) instead of /v1/completions (prompt)
    ignore_eos: bool = False
    sampling: dict[str, Any] | None = None  # temperature, top_p, ... sent as they are


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


class ServerStreamError(RuntimeError):
    """The server sent an error event inside the stream."""


class _StreamState:
    """Folds SSE events into a RequestResult as they arrive."""

    def __init__(self, result: RequestResult, chat: bool) -> None:
        self.result = result
        self.chat = chat
        self.last_chunk = 0.0
        self.end = 0.0  # when [DONE] arrived
        self.num_chunks = 0
        self.usage_tokens: int | None = None
        self.texts: list[str] = []

    def on_data(self, payload: bytes) -> bool:
        """One SSE data payload; True at [DONE]."""
        now = time.perf_counter()
        if payload == b"[DONE]":
            self.end = now
            return True
        data = orjson.loads(payload)
        if usage := data.get("usage"):
            self.usage_tokens = usage.get("completion_tokens")
        if "error" in data:
            raise ServerStreamError(str(data["error"]))
        text = "".join(_chunk_text(c, self.chat) for c in data.get("choices") or [])
        if text:
            self._on_text(text, now)
        return False

    def _on_text(self, text: str, now: float) -> None:
        if self.num_chunks == 0:
            self.result.ttft = now - self.result.start_time
        else:
            self.result.itl.append(now - self.last_chunk)
        self.last_chunk = now
        self.num_chunks += 1
        self.texts.append(text)


def _finish(state: _StreamState, tokenizer: Any) -> None:
    r = state.result
    r.latency = (state.end or time.perf_counter()) - r.start_time
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


async def send_request(
    transport: H11Transport | HttpxTransport,
    spec: RequestSpec,
    prompt: str | list[int],
    prompt_len: int,
    max_tokens: int,
    tokenizer: Any = None,
) -> RequestResult:
    """Stream one request; failures land in ``result.error``, never raise (except cancel)."""
    result = RequestResult(prompt_len=prompt_len)
    state = _StreamState(result, spec.chat)
    body = orjson.dumps(build_payload(spec, prompt, max_tokens))
    result.start_time = time.perf_counter()
    try:
        status, error_body = await transport.post_sse(spec.api_url, body, state.on_data)
    except (TransportError, ServerStreamError, orjson.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}" if not isinstance(e, TransportError) else str(e)
        return result
    if status != 200:
        result.error = f"HTTP {status}: {error_body.decode(errors='replace')[:ERROR_BODY_CHARS]}"
        return result
    _finish(state, tokenizer)
    return result
