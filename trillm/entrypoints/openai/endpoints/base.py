"""The server's state, which every stage of a route reads: the engine it forwards to, the
served names, the limits, and the admission counts (changed only by ``admission.py``).

It is the bottom of the endpoints' layers, below the engine too (which asks
``accepts_prompts``): it calls nothing but the error types. Each stage's helpers
live in that stage's module (``admission``, ``budgets``, ``usage``, ``logprob_json``, ...).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
import trio

from trillm.entrypoints.openai.endpoints.budgets import (
    DEFAULT_MAX_LOGPROB_ENTRIES,
    DEFAULT_MAX_SEQUENCES_PER_REQUEST,
)
from trillm.entrypoints.openai.http.errors import (
    NotFoundError,
)
from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
from trillm.entrypoints.openai.metrics.tracing import RequestTracing
from trillm.lora.request import LoRARequest

if TYPE_CHECKING:
    from trillm.config import ModelConfig
    from trillm.engine.async_engine import AsyncEngine
    from trillm.engine.preprocess import Preprocessor
    from trillm.entrypoints.openai.endpoints.lora import LoRARegistry
    from trillm.entrypoints.openai.endpoints.responses_store import ResponseStore
    from trillm.tokenizer_protocol import Tokenizer


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
    # --enable-prompt-tokens-details, --enable-force-include-usage (cli/answer_flags.py).
    enable_prompt_tokens_details: bool = False
    enable_force_include_usage: bool = False
    # --return-tokens-as-token-ids (a request's own field wins), --enable-tokenizer-info-endpoint.
    return_tokens_as_token_ids: bool = False
    enable_tokenizer_info_endpoint: bool = False
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
    # --otlp-traces-endpoint: each request's spans (metrics/tracing.py); None: not traced.
    tracing: RequestTracing | None = None
    # VLLM_ENABLE_RESPONSES_API_STORE=1: the stored responses (responses_store.py); None: off.
    responses_store: ResponseStore | None = None

    @property
    def tokenizer(self) -> Tokenizer:
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

    def accepts_prompts(self) -> bool:
        """Whether a request's next prompt may enter the engine (fair admission asks, as
        ``may_start``): not once the server drains."""
        return not self.draining


def max_prompt_chars(state: ServerState) -> int:
    """The longest text (in characters) the context could hold (computed once per engine)."""
    return int(state.preprocessor.max_prompt_chars())
