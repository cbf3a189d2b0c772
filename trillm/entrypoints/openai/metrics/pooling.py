"""A pooling request (/v1/embeddings, /pooling, /classify, /score, /rerank) on /metrics and in
traces, as vLLM records one.

Each input is one engine request; vLLM's pooling routes hand the HTTP request's trace headers
to ``encode`` for each, and its output processor traces and records every finished engine
request, pooling or not. So here: the input's one output (its vector, or its class
probabilities) is its first token (TTFT, the prefill, its prompt tokens counted), no token is
generated (``gen_ai.usage.completion_tokens`` 0, a decode of 0 s), and it ends as "stop"
(vLLM's scheduler stops a pooling request once its output exists). Its ``llm_request`` span
(``tracing.RequestTrace``) carries what the histograms observed, as for generation; it has no
sampling attributes (a pooling request has no max_tokens, temperature, top_p or n)."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from trillm.entrypoints.openai.metrics.requests import RequestSeries, RequestTimer, Sample
from trillm.outputs import RequestOutput

if TYPE_CHECKING:
    from trillm.entrypoints.openai.metrics.tracing import RequestTrace
    from trillm.outputs import ClassificationRequestOutput, PoolingRequestOutput


class PoolingTimer(RequestTimer):
    """One pooling request's inputs, each recorded when its output arrives (``pooled``);
    ``close`` ends those that never got one."""

    __slots__ = ("inputs",)

    def __init__(
        self, per_engine: list[RequestSeries], inputs: int, trace: RequestTrace | None
    ) -> None:
        super().__init__(per_engine, time.perf_counter())
        self.inputs = inputs
        if trace is not None:
            self.on_end = trace.sample_ended

    def pooled(self, job: int, result: PoolingRequestOutput | ClassificationRequestOutput) -> None:
        """Input ``job``'s output arrived now."""
        now = time.perf_counter()
        # The engine's side of it (its times, its core) as the request series read it.
        out = RequestOutput(
            result.request_id, None, result.prompt_token_ids, None, [], True, metrics=result.metrics
        )
        series = self._series(out)
        s = self.samples[(job, 0)] = Sample(series, len(result.prompt_token_ids))
        s.first = s.last = now
        series.ttft.observe(now - self.start)
        series.prompt_tokens.value += s.prompt_len
        self._end(now, s, "stop", out)

    def close(self) -> None:
        """The HTTP request is over: inputs without their output (a sibling failed, the
        client left) end as aborted."""
        self.finished(time.perf_counter(), 0, ["abort"] * self.inputs)
