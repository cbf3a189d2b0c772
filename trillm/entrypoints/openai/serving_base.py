"""What the chat and completion endpoints share: the server state, per-request usage and
metrics bookkeeping, logprob formatting, tokenization helpers.
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import attrs
import trio

from trillm.entrypoints.openai.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
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
    # Tool calling and reasoning (issue 12; chat_parsing.py).
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None
    exclude_tools_when_tool_choice_none: bool = False
    reasoning_parser: str | None = None
    draining: bool = False
    # Engine sequences admitted at once (--max-num-seqs + --max-num-queued-requests); None:
    # no bound. Past it a request gets 503 + Retry-After before it reaches the engine.
    max_admitted: int | None = None
    # Engine request id -> its sequences (n), for those in flight: the admission count, and
    # what shutdown aborts once --shutdown-timeout has passed. Only an Admission changes it.
    inflight: dict[str, int] = attrs.field(factory=dict)
    admitted: int = 0  # the sum of ``inflight``'s values
    drained: trio.Event = attrs.field(factory=trio.Event)  # set once draining and none in flight
    # Long texts are tokenized in threads; each can take many times the text's size in memory
    # while it runs, so only a few at once (the rest wait their turn).
    tokenize_limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(max(1, min(4, os.cpu_count() or 1)))
    )
    # Texts of LARGE_TOKENIZE_CHARS and more (hundreds of MB of working memory): one at a time.
    large_tokenize_limiter: trio.CapacityLimiter = attrs.field(
        factory=lambda: trio.CapacityLimiter(1)
    )
    _max_prompt_chars: int | None = None
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

    def check_capacity(self, seqs: int = 1) -> None:
        """503 (the caller adds Retry-After) when ``seqs`` more sequences would overfill the
        queue: all of a request's prompts and samples are admitted together or not at all."""
        limit = self.max_admitted
        if limit is not None and self.admitted + seqs > limit:
            raise ServiceUnavailableError(
                f"The server is overloaded ({self.admitted} sequences running or queued, the "
                f"limit is {limit}); this request needs {seqs}. Retry later."
            )

    def admit(self, request_ids: list[str], seqs_each: int) -> Admission:
        """Reserve the request's sequences; the Admission must be released on every path out."""
        self.check_capacity(len(request_ids) * seqs_each)
        for rid in request_ids:
            if rid in self.inflight:
                raise BadRequestError(
                    f"A request with id {rid!r} is already running.", "request_id"
                )
        for rid in request_ids:
            self.inflight[rid] = seqs_each
        self.admitted += len(request_ids) * seqs_each
        return Admission(self, request_ids)

    def _release(self, request_id: str) -> None:
        self.admitted -= self.inflight.pop(request_id)
        if self.draining and not self.inflight:
            self.drained.set()

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text


class Admission:
    """A request's place in ``ServerState.inflight``: each id is released exactly once, by
    ``release`` (one id, when its engine request ends) or ``release_all`` (the request's
    owner leaving by any path: finish, error, disconnect, cancellation, shutdown)."""

    __slots__ = ("state", "pending")

    def __init__(self, state: ServerState, request_ids: list[str]) -> None:
        self.state = state
        self.pending = set(request_ids)

    def release(self, request_id: str) -> None:
        if request_id in self.pending:
            self.pending.discard(request_id)
            self.state._release(request_id)

    def release_all(self) -> None:
        for request_id in list(self.pending):
            self.release(request_id)


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
        self.timer.output(time.perf_counter(), out, job)  # metrics per engine request
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


# NOTE: the text one token can stand for is at most its vocabulary entry (byte-level BPE
# entries spell one character per byte; SentencePiece and WordPiece entries spell their text,
# plus markers), so a prompt longer than max_model_len x the longest entry cannot fit. The x2
# covers pre-tokenizers that drop a separator between tokens (BERT's whitespace split); only
# texts mostly made of characters a tokenizer deletes (long whitespace runs for such
# tokenizers, control characters) could fit yet be refused. The floor of 32 keeps the bound
# generous for character-level vocabularies.
_MIN_CHARS_PER_TOKEN = 32
_SAFETY_FACTOR = 2
INLINE_TOKENIZE_CHARS = 20_000  # shorter texts are tokenized on the event loop
LARGE_TOKENIZE_CHARS = 1_000_000  # longer ones are tokenized one at a time


def max_prompt_chars(state: ServerState) -> int:
    """The longest text (in characters) that could tokenize to at most max_model_len tokens."""
    if state._max_prompt_chars is None:
        tok = state.tokenizer
        longest = max((len(k) for k in tok.get_vocab()), default=1)
        added = getattr(tok, "added_tokens_decoder", None) or {}
        longest = max([longest, *(len(str(t)) for t in added.values())])
        per_token = max(longest, _MIN_CHARS_PER_TOKEN) * _SAFETY_FACTOR
        state._max_prompt_chars = state.model_config.max_model_len * per_token
    return state._max_prompt_chars


async def tokenize_text(
    state: ServerState,
    text: str,
    add_special_tokens: bool,
    param: str = "prompt",
    truncating: bool = False,
) -> list[int]:
    """Token ids of ``text``; a text too long for the context is refused before any work,
    unless the request truncates it (``truncate_prompt_tokens``: the whole text is tokenized,
    as vLLM does, within the bounded tokenization threads and the body-size limit)."""
    limit = max_prompt_chars(state)
    if len(text) > limit and not truncating:
        max_len = state.model_config.max_model_len
        raise BadRequestError(
            f"This model's maximum context length is {max_len} tokens. However, your prompt "
            f"has {len(text)} characters, more than {max_len} tokens can hold (at most {limit} "
            "characters for this tokenizer). Please reduce the length of the input.",
            param,
        )
    encode = state.tokenizer.encode
    if len(text) < INLINE_TOKENIZE_CHARS:
        return list(encode(text, add_special_tokens=add_special_tokens))

    # NOTE: long prompts are tokenized off the event loop so streams keep flowing, a few at
    # a time (a tokenizer's working memory is many times the text's size: ~150 bytes a
    # character for a fast tokenizer), the largest one at a time.
    def work() -> list[int]:
        return list(encode(text, add_special_tokens=add_special_tokens))

    if len(text) < LARGE_TOKENIZE_CHARS:
        return await trio.to_thread.run_sync(work, limiter=state.tokenize_limiter)
    async with state.large_tokenize_limiter:
        return await trio.to_thread.run_sync(work, limiter=state.tokenize_limiter)


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    vocab = state.model_config.vocab_size
    for t in ids:
        if not 0 <= t < vocab:
            raise BadRequestError(
                f"Token id {t} in '{param}' is outside the vocabulary [0, {vocab}).", param
            )
