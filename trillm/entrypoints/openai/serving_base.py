"""What the chat and completion endpoints share: the server state, per-request usage and
metrics bookkeeping, logprob formatting, tokenization helpers.
"""

from __future__ import annotations

import math
import time
from typing import Any

import attrs
import trio

from trillm.entrypoints.openai.errors import APIError, BadRequestError, NotFoundError
from trillm.entrypoints.openai.metrics import RequestTimer, ServerMetrics


@attrs.define(eq=False)
class ServerState:
    engine: Any
    served_model_names: list[str]
    metrics: ServerMetrics
    nursery: trio.Nursery
    chat_template: str | None = None
    trust_request_chat_template: bool = False
    max_logprobs: int = 20
    draining: bool = False
    # Engine request ids in flight: shutdown aborts those that outlive --shutdown-timeout.
    inflight: set[str] = attrs.field(factory=set)
    drained: trio.Event = attrs.field(factory=trio.Event)  # set once draining and none in flight
    _token_text: dict[int, str] = attrs.field(factory=dict)

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def model_config(self) -> Any:
        return self.engine.model_config

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.served_model_names:
            raise NotFoundError(f"The model `{model}` does not exist.", "model")

    def track(self, request_id: str) -> None:
        self.inflight.add(request_id)

    def untrack(self, request_id: str) -> None:
        self.inflight.discard(request_id)
        if self.draining and not self.inflight:
            self.drained.set()

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


# ---------------------------------------------------------------- outputs


@attrs.define(eq=False)
class ChoiceState:
    """Accumulated output of one choice (non-streaming) or its bookkeeping (streaming)."""

    index: int
    texts: list[str] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: list[Any] = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: Any) -> None:
        if c.text:
            self.texts.append(c.text)
        self.token_ids.extend(c.token_ids)
        if c.logprobs:
            self.logprobs.extend(c.logprobs)
        if c.finish_reason is not None:
            self.finish_reason = str(c.finish_reason)
            self.stop_reason = c.stop_reason

    @property
    def text(self) -> str:
        return "".join(self.texts)


class RequestTracker:
    """Per-request counters for usage and metrics across its prompts and choices."""

    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "timer", "reasons")

    def __init__(self, state: ServerState, prompt_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: dict[int, int] = {}  # job index -> prompt tokens from the cache
        self.completion_tokens = 0
        self.timer = RequestTimer(state.metrics, time.perf_counter())
        self.reasons: list[str] = []

    def observe(self, out: Any, job: int = 0) -> None:
        count = 0
        for c in out.outputs:
            count += len(c.token_ids)
            if c.finish_reason is not None:
                self.reasons.append(str(c.finish_reason))
        self.completion_tokens += count
        self.timer.tokens(time.perf_counter(), count)
        if out.num_cached_tokens:
            self.cached_tokens[job] = out.num_cached_tokens

    def finish(self, num_choices: int) -> None:
        missing = num_choices - len(self.reasons)
        self.reasons.extend(["abort"] * max(missing, 0))
        self.timer.finished(time.perf_counter(), self.prompt_tokens, self.reasons)

    def usage(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": sum(self.cached_tokens.values())},
        }


def raise_if_error(item: Any) -> Any:
    if isinstance(item, APIError):
        raise item
    return item


def position_logprobs(state: ServerState, entry: Any, token_id: int) -> tuple[float, list]:
    """One position's logprobs: the chosen token's value and ``[(id, text, logprob)]`` by rank.

    ``entry`` maps token id -> Logprob (``.logprob``, ``.rank``) or a float.
    """
    ranked = []
    chosen = -math.inf
    for tid, lp in entry.items():
        value = float(getattr(lp, "logprob", lp))
        if tid == token_id:
            chosen = value
        ranked.append(
            (getattr(lp, "rank", None) or 0, tid, value, getattr(lp, "decoded_token", None))
        )
    ranked.sort(key=lambda r: (r[0] if r[0] else math.inf, -r[2]))
    tops = [(tid, text if text is not None else state.token_text(tid), value)
            for _, tid, value, text in ranked]  # fmt: skip
    return chosen, tops


def prompt_logprobs_json(state: ServerState, prompt_logprobs: Any) -> list | None:
    """vLLM's shape: ``[null | {token_id: {logprob, rank, decoded_token}}]`` per prompt token."""
    if prompt_logprobs is None:
        return None
    out: list[Any] = []
    for entry in prompt_logprobs:
        if entry is None:
            out.append(None)
            continue
        out.append(
            {
                str(tid): {
                    "logprob": float(getattr(lp, "logprob", lp)),
                    "rank": getattr(lp, "rank", None),
                    "decoded_token": getattr(lp, "decoded_token", None) or state.token_text(tid),
                }
                for tid, lp in entry.items()
            }
        )
    return out


async def tokenize_text(state: ServerState, text: str, add_special_tokens: bool) -> list[int]:
    encode = state.tokenizer.encode
    if len(text) < 20_000:
        return list(encode(text, add_special_tokens=add_special_tokens))
    # NOTE: long prompts are tokenized off the event loop so streams keep flowing.
    return list(
        await trio.to_thread.run_sync(lambda: encode(text, add_special_tokens=add_special_tokens))
    )


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.model_config.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise BadRequestError(
                f"Token id {t} in '{param}' is outside the vocabulary [0, {vocab}).", param
            )
