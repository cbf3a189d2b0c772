"""What the chat and completion endpoints share: the server state, per-request usage and
metrics bookkeeping, logprob formatting. Tokenization and request checks are the engine's
(``trillm/engine/preprocess.py``, ``state.preprocessor``).
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import attrs
import orjson
import trio

from trillm.engine.logprobs import in_rank_order
from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.endpoints.budgets import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
)
from trillm.entrypoints.openai.http.errors import (
    APIError,
    BadRequestError,
    NotFoundError,
    ServiceUnavailableError,
)
from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
from trillm.lora.request import LoRARequest
from trillm.outputs import Logprob

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from trillm.config import ModelConfig
    from trillm.engine.async_engine import AsyncEngine
    from trillm.engine.preprocess import Preprocessor
    from trillm.entrypoints.openai.endpoints.lora import LoRARegistry


@attrs.define(eq=False)
class ServerState:
    engine: AsyncEngine  # (the server's EngineSlot, read as the engine it forwards to)
    served_model_names: list[str]
    metrics: ServerMetrics
    nursery: trio.Nursery
    trust_request_chat_template: bool = False
    max_logprobs: int = 20
    # Tool calling and reasoning (chat_parsing.py).
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
    # Tokens admitted at once (--max-num-admitted-tokens): each sequence counts its prompt plus
    # its max_tokens, what it may come to hold in the KV cache. None: no bound.
    max_admitted_tokens: int | None = None
    # Engine request id -> its tokens (all its sequences), for those in flight; only an
    # Admission changes it.
    inflight_tokens: dict[str, int] = attrs.field(factory=dict)
    admitted_tokens: int = 0  # the sum of ``inflight_tokens``' values
    drained: trio.Event = attrs.field(factory=trio.Event)  # set once draining and none in flight
    # LoRA adapters served by name (endpoints.lora.LoRARegistry); None without --enable-lora.
    loras: LoRARegistry | None = None
    # Per-request budgets (request_budgets.py): logprob entries, and prompts x n.
    max_logprob_entries: int = DEFAULT_MAX_LOGPROB_ENTRIES
    max_sequences_per_request: int = DEFAULT_MAX_SEQUENCES_PER_REQUEST
    # Fair admission: the most sequences one request has in the engine at once (3/4 of its
    # batch, --max-num-seqs x data-parallel size); its other prompts wait in the frontend, so
    # a later request is not queued behind all of it. None: no bound.
    max_engine_seqs_per_request: int | None = None

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:  # (the routes that use it need one)
        return self.engine.tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.engine.model_config

    @property
    def preprocessor(self) -> Preprocessor:
        """Stage 2 of the current engine."""
        return self.engine.preprocessor

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def check_model(self, model: str | None) -> LoRARequest | None:
        """404 for an unknown model; the adapter when ``model`` names one (else None)."""
        if model is None or model in self.served_model_names:
            return None
        lora = None if self.loras is None else self.loras.adapters.get(model)
        if lora is None:
            # Served names are short: a long one is echoed only in part (a 4 MiB name would
            # be a 4 MiB answer).
            shown = model if len(model) <= 256 else f"{model[:256]}... ({len(model)} characters)"
            raise NotFoundError(f"The model `{shown}` does not exist.", "model")
        return lora

    def check_capacity(self, seqs: int = 1, tokens: int = 1) -> None:
        """503 (the caller adds Retry-After) when ``seqs`` more sequences or ``tokens`` more
        tokens would overfill the queue: all of a request's prompts and samples are admitted
        together or not at all. (The defaults ask whether any request at all fits.)"""
        limit = self.max_admitted
        if limit is not None and self.admitted + seqs > limit:
            raise ServiceUnavailableError(
                f"The server is overloaded ({self.admitted} sequences running or queued, the "
                f"limit is {limit}); this request needs {seqs}. Retry later."
            )
        token_limit = self.max_admitted_tokens
        if token_limit is not None and tokens > token_limit:
            # Never admitted, however long the client waits: a 400, not a 503 to retry.
            raise BadRequestError(
                f"This request needs {tokens} tokens (prompt tokens plus max_tokens, for each "
                f"prompt and sample), more than this server admits at once ({token_limit}, "
                "--max-num-admitted-tokens). Lower max_tokens or n, or send fewer prompts.",
                "max_tokens",
            )
        if token_limit is not None and self.admitted_tokens + tokens > token_limit:
            raise ServiceUnavailableError(
                f"The server is overloaded ({self.admitted_tokens} tokens running or queued, "
                f"the limit is {token_limit}); this request needs {tokens} (prompt tokens plus "
                "max_tokens, for each prompt and sample). Retry later."
            )

    def admit(
        self, request_ids: list[str], seqs_each: int, tokens: list[int] | None = None
    ) -> Admission:
        """Reserve the request's sequences (and ``tokens``: per id, its prompt plus max_tokens
        times its sequences); the Admission must be released on every path out."""
        token_counts = tokens if tokens is not None else [0] * len(request_ids)
        self.check_capacity(len(request_ids) * seqs_each, sum(token_counts))
        for rid in request_ids:
            if rid in self.inflight:
                raise BadRequestError(
                    f"A request with id {rid!r} is already running.", "request_id"
                )
        for rid, count in zip(request_ids, token_counts, strict=True):
            self.inflight[rid] = seqs_each
            self.inflight_tokens[rid] = count
        self.admitted += len(request_ids) * seqs_each
        self.admitted_tokens += sum(token_counts)
        return Admission(self, request_ids)

    def _release(self, request_id: str) -> None:
        self.admitted -= self.inflight.pop(request_id)
        self.admitted_tokens -= self.inflight_tokens.pop(request_id)
        if self.draining and not self.inflight:
            self.drained.set()

    def token_text(self, token_id: int) -> str:
        """A token's text, from the engine's cache (the one the logprob entries use)."""
        return self.engine.token_text(token_id)


def split_prompts(value: str | list[Any], param: str) -> list[str | list[int]]:
    """A request's ``prompt`` / ``input`` as its prompts: a text, a list of texts, token ids
    (one prompt) or a list of token-id lists; empty: a 400 naming ``param``."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise BadRequestError(f"'{param}' must not be empty.", param)
    if isinstance(value[0], int):
        return [value]  # one prompt as token ids
    return list(value)


def admitted_tokens(job: PreparedPrompt) -> int:
    """What one prepared prompt counts against --max-num-admitted-tokens: each of its
    sequences may come to hold the prompt and max_tokens in the KV cache."""
    return job.params.n * (len(job.prompt_token_ids) + (job.params.max_tokens or 0))


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

    def __init__(
        self,
        state: ServerState,
        prompt_tokens: int,
        params: tuple[int, int | None, int] | None = None,  # n, max_tokens, prompts
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.cached_tokens: dict[int, int] = {}  # job index -> prompt tokens from the cache
        self.completion_tokens = 0
        self.timer = state.metrics.timer(time.perf_counter(), params)
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


def position_logprobs(entry: dict[int, Logprob], token_id: int) -> tuple[float, list]:
    """One position's logprobs, as the output processor formatted them: the chosen token's
    value and ``[(id, text, logprob)]`` by rank (``in_rank_order``: no sorting here)."""
    chosen = entry[token_id].logprob if token_id in entry else -math.inf
    tops = [(tid, lp.decoded_token or "", lp.logprob) for tid, lp in in_rank_order(entry)]
    return chosen, tops


# Prompt positions serialized between two event-loop checkpoints: at 20 logprobs, ~5k entries
# (a few ms), so a large answer never holds other requests and /health for long.
_PROMPT_LOGPROB_POSITIONS_PER_SLICE = 256


async def prompt_logprobs_json(prompt_logprobs: Any) -> orjson.Fragment | None:
    """vLLM's shape, ``[null | {token_id: {logprob, rank, decoded_token}}]`` per prompt token,
    as JSON ready to embed in the answer: serialized a slice of positions at a time, yielding
    to the event loop between slices, and never built whole as Python dicts (~7x the JSON)."""
    if prompt_logprobs is None:
        return None
    pieces: list[bytes] = []
    step = _PROMPT_LOGPROB_POSITIONS_PER_SLICE
    for start in range(0, len(prompt_logprobs), step):
        rows = [_prompt_position_json(entry) for entry in prompt_logprobs[start : start + step]]
        pieces.append(orjson.dumps(rows)[1:-1])  # the rows without their brackets
        await trio.lowlevel.checkpoint()
    return orjson.Fragment(b"[" + b",".join(pieces) + b"]")


def _prompt_position_json(entry: dict[int, Logprob] | None) -> dict[str, Any] | None:
    if entry is None:
        return None
    return {
        str(tid): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
        for tid, lp in entry.items()
    }


def max_prompt_chars(state: ServerState) -> int:
    """The longest text (in characters) the context could hold (computed once per engine)."""
    return int(state.preprocessor.max_prompt_chars())
