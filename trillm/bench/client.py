"""One streaming request to an OpenAI-compatible server, timed chunk by chunk.

A chunk counts as a token arrival when it carries generated text (``choices[].text`` or
``delta.content``/``reasoning_content``); role-only and empty end chunks do not, so TTFT is
the wait for the first visible token. Output tokens come from the usage chunk
(``stream_options.include_usage``), else from the tokenizer, else from the chunk count.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from trillm.bench.metrics import RequestResult
from trillm.bench.transport import H11Transport, HttpxTransport, TransportError

if TYPE_CHECKING:
    from trillm.bench.datasets import TokenizerLike

ERROR_BODY_CHARS = 300


@dataclass(slots=True)
class RequestSpec:
    """What every request of a run shares, besides its prompt."""

    api_url: str  # base_url + endpoint
    model: str
    chat: bool  # /v1/chat/completions (messages) instead of /v1/completions (prompt)
    ignore_eos: bool = False
    sampling: dict[str, Any] | None = None  # temperature, top_p, ... sent as they are
    extra_body: dict[str, Any] | None = None  # --extra-body: merged into every body, last
    headers: dict[str, str] | None = None  # --header KEY=VALUE
    request_id_prefix: str | None = None  # request i: x-request-id / request_id PREFIX + i
    logprobs: int | None = None  # --logprobs
    # --lora-modules: the names sent as 'model' instead of ``model`` (one chosen per request)
    lora_modules: list[str] | None = None
    lora_round_robin: bool = False

    def model_for(self, index: int, rng: Any = None) -> str:
        if not self.lora_modules:
            return self.model
        if self.lora_round_robin or rng is None:
            return self.lora_modules[index % len(self.lora_modules)]
        return self.lora_modules[int(rng.integers(len(self.lora_modules)))]

    def request_headers(self, index: int | None) -> dict[str, str]:
        headers = dict(self.headers or {})
        if index is not None and self.request_id_prefix is not None:
            headers["x-request-id"] = f"{self.request_id_prefix}{index}"
        return headers


def build_payload(
    spec: RequestSpec,
    prompt: str | list[int] | list[dict[str, Any]],
    max_tokens: int,
    index: int | None = None,
    model: str | None = None,
) -> dict[str, Any]:
    """The request body; ``index``: the request's number (its request id), None for the test
    and warm-up requests; ``model``: the LoRA name chosen for it."""
    payload: dict[str, Any] = {
        "model": model or spec.model,
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
    if spec.logprobs is not None:
        if spec.chat:
            payload["logprobs"], payload["top_logprobs"] = True, spec.logprobs
        else:
            payload["logprobs"] = spec.logprobs
    if index is not None and spec.request_id_prefix is not None:
        payload["request_id"] = f"{spec.request_id_prefix}{index}"
    payload.update(spec.extra_body or {})
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


def _finish(state: _StreamState, tokenizer: TokenizerLike | None) -> None:
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
    prompt: str | list[int] | list[dict[str, Any]],
    prompt_len: int,
    max_tokens: int,
    tokenizer: TokenizerLike | None = None,
    index: int | None = None,
    model: str | None = None,
) -> RequestResult:
    """Stream one request; failures land in ``result.error``, never raise (except cancel)."""
    result = RequestResult(prompt_len=prompt_len)
    state = _StreamState(result, spec.chat)
    body = orjson.dumps(build_payload(spec, prompt, max_tokens, index, model))
    headers = spec.request_headers(index)
    result.start_time = time.perf_counter()
    try:
        status, error_body = await transport.post_sse(spec.api_url, body, state.on_data, headers)
    except (TransportError, ServerStreamError, orjson.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}" if not isinstance(e, TransportError) else str(e)
        return result
    if status != 200:
        result.error = f"HTTP {status}: {error_body.decode(errors='replace')[:ERROR_BODY_CHARS]}"
        return result
    _finish(state, tokenizer)
    return result
