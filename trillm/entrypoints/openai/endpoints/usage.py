"""What a generation's reader keeps while it reads (stage 11, chat and completions): each
choice's accumulated output for a JSON answer, and the request's usage and metrics."""

from __future__ import annotations

import time
from typing import Any

import attrs

from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics
from trillm.entrypoints.openai.metrics.tracing import RequestTrace
from trillm.entrypoints.openai.schemas.protocol import StreamOptions
from trillm.outputs import CompletionOutput, RequestOutput, SampleLogprobs


def stream_usage(opts: StreamOptions | None, force: bool) -> tuple[bool, bool]:
    """vLLM's ``should_include_usage``: (a usage chunk ends the stream, usage on every chunk).
    ``continuous_usage_stats`` counts only with ``include_usage``; ``force``
    (--enable-force-include-usage) turns both on."""
    if force:
        return True, True
    include = opts is not None and opts.include_usage
    return include, include and opts is not None and opts.continuous_usage_stats


@attrs.define(eq=False)
class ChoiceState:
    """Accumulated output of one choice (a JSON answer's)."""

    index: int
    texts: list[str] = attrs.field(factory=list)
    token_ids: list[int] = attrs.field(factory=list)
    logprobs: SampleLogprobs = attrs.field(factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def add(self, c: CompletionOutput) -> None:
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

    __slots__ = (
        "prompt_tokens",
        "cached_tokens",
        "created_tokens",
        "report_created",
        "completion_tokens",
        "timer",
        "reasons",
        "details",
    )

    def __init__(
        self,
        metrics: ServerMetrics,
        prompt_tokens: int,
        params: tuple[int, int | None, int] | None = None,  # n, max_tokens, prompts
        details: bool = False,  # --enable-prompt-tokens-details
        trace: RequestTrace | None = None,  # --otlp-traces-endpoint: a span per engine request
        report_created: bool = False,  # chat's details give created_cache_tokens (vLLM's)
    ) -> None:
        self.prompt_tokens = prompt_tokens
        self.details = details
        self.report_created = report_created
        self.cached_tokens: dict[int, int] = {}  # job index -> prompt tokens from the cache
        self.created_tokens: dict[int, int] = {}  # job index -> prompt tokens written to it
        self.completion_tokens = 0
        self.timer = metrics.timer(time.perf_counter(), params)
        if trace is not None:  # the span gets the figures /metrics observes
            self.timer.on_end = trace.sample_ended
        self.reasons: list[str] = []

    def observe(self, out: RequestOutput, job: int = 0) -> None:
        count = 0
        for c in out.outputs:
            count += len(c.token_ids)
            if c.finish_reason is not None:
                self.reasons.append(str(c.finish_reason))
        self.completion_tokens += count
        self.timer.output(time.perf_counter(), out, job)  # metrics per engine request
        if out.num_cached_tokens:
            self.cached_tokens[job] = out.num_cached_tokens
        if out.num_cache_creation_tokens:
            self.created_tokens[job] = out.num_cache_creation_tokens

    def finish(self, num_choices: int) -> None:
        missing = num_choices - len(self.reasons)
        self.reasons.extend(["abort"] * max(missing, 0))
        self.timer.finished(time.perf_counter(), self.prompt_tokens, self.reasons)

    def cached_total(self) -> int:
        """Prompt tokens read from the prefix cache, over the request's prompts."""
        return sum(self.cached_tokens.values())

    def cache_totals(self) -> tuple[int, int]:
        """(prompt tokens read from the prefix cache, prompt tokens computed and written to it:
        vLLM's num_cache_creation_tokens), over the request's prompts."""
        return self.cached_total(), sum(self.created_tokens.values())

    def usage(self) -> dict[str, Any]:
        # As vLLM: prompt_tokens_details is null unless --enable-prompt-tokens-details; chat's
        # has created_cache_tokens too, completions' only cached_tokens.
        details: dict[str, int] | None = None
        if self.details:
            details = {"cached_tokens": self.cached_total()}
            if self.report_created:
                details["created_cache_tokens"] = sum(self.created_tokens.values())
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": details,
        }
