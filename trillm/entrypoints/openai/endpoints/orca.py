"""vLLM's ORCA load report: a chat or completion request that sends
``endpoint-load-metrics-format: TEXT`` (or ``JSON``) gets, on its JSON answer, an
``endpoint-load-metrics`` header with the engine's KV-cache usage and waiting requests at
answer time, for a load balancer that routes by load (Envoy's ORCA). Other formats (BIN):
no header, as in vLLM."""

from __future__ import annotations

import json

from quart import Response, request

from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.metrics.prometheus import engine_stats

FORMAT_HEADER = "endpoint-load-metrics-format"
REPORT_HEADER = "endpoint-load-metrics"


def add_load_report(state: ServerState, response: Response) -> Response:
    """``response`` with the report when the request asked for one and it is a JSON answer
    (a stream's headers leave before its load is known: none, as in vLLM)."""
    fmt = request.headers.get(FORMAT_HEADER, "").strip().upper()
    if fmt in ("TEXT", "JSON") and response.mimetype == "application/json":
        response.headers[REPORT_HEADER] = load_report(state, fmt)
    return response


def load_report(state: ServerState, fmt: str) -> str:
    stats = engine_stats(state.engine)[0]  # (vLLM reads the first engine's gauges)
    named = {
        "kv_cache_usage_perc": float(stats.kv_cache_usage),
        "num_requests_waiting": float(stats.num_waiting_reqs),
    }
    if fmt == "TEXT":
        return "TEXT " + ", ".join(f"named_metrics.{k}={v}" for k, v in named.items())
    return "JSON " + json.dumps({"named_metrics": named})
