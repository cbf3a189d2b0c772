"""vLLM's ``http_*`` series (prometheus_fastapi_instrumentator's defaults) as an ASGI wrapper.

- ``http_requests_total{handler, method, status}`` (status grouped: ``2xx``, ``4xx``, ...);
- ``http_request_duration_seconds{handler, method}`` and the unlabelled, finer
  ``http_request_duration_highr_seconds`` histograms, until the response's last byte (a
  stream's whole length);
- ``http_request_size_bytes{handler}`` / ``http_response_size_bytes{handler}`` summaries
  (``Content-Length`` of the request, bytes of the response body sent).

No label value comes from the client unbounded (one series per value: a client choosing them
would grow every scrape without end). ``handler`` is the route's template as the instrumentator
names it (``/v1/completions``, ``/v1/responses/{response_id}``), ``none`` for a path no route
serves (its default ``should_group_untemplated``); ``method`` is the request's method if HTTP
defines it (RFC 9110 and PATCH), ``other`` for any other token: the instrumentator takes it as
sent, and 1,000 distinct 4,000-character methods grew /metrics to 28.6 MB. Plain counters, as
metrics/requests.Hist: one Trio thread.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from prometheus_client.core import CounterMetricFamily, SummaryMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from trillm.entrypoints.openai.metrics.requests import Hist

_DURATION_BUCKETS = (0.1, 0.5, 1.0)  # the instrumentator's default latency_lowr_buckets
_HIGHR_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    1.5,
    2.0,
    2.5,
    3.0,
    3.5,
    4.0,
    4.5,
    5.0,
    7.5,
    10.0,
    30.0,
    60.0,
)
METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
OTHER_METHOD = "other"
UNMATCHED = "none"
_VARIABLE = re.compile(r"<(?:(\w+):)?(\w+)>")  # a route variable: <name>, <converter:name>


class Routes:
    """The ``handler`` label of a path: the template of the route that serves it, or
    ``UNMATCHED``."""

    def __init__(self, rules: Iterable[str]) -> None:
        self.exact: set[str] = set()
        # (pattern, label) of each rule with variables
        self.templated: list[tuple[re.Pattern[str], str]] = []
        for rule in rules:
            if _VARIABLE.search(rule) is None:
                self.exact.add(rule)
            else:
                self.templated.append((_pattern(rule), _VARIABLE.sub(r"{\2}", rule)))

    def handler(self, path: str) -> str:
        if path in self.exact:
            return path
        for pattern, label in self.templated:
            if pattern.fullmatch(path):
                return label
        return UNMATCHED


def _pattern(rule: str) -> re.Pattern[str]:
    """The paths a rule matches: a variable is one path segment (a ``path`` one, any rest)."""
    parts, end = [], 0
    for var in _VARIABLE.finditer(rule):
        parts.append(re.escape(rule[end : var.start()]))
        parts.append(".+" if var.group(1) == "path" else "[^/]+")
        end = var.end()
    parts.append(re.escape(rule[end:]))
    return re.compile("".join(parts))


def method_label(method: str) -> str:
    return method if method in METHODS else OTHER_METHOD


class HTTPMetrics(Collector):
    """The ASGI wrapper and the collector of its series."""

    def __init__(self, app: Any, handlers: Iterable[str]) -> None:
        self.app = app
        self.routes = Routes(handlers)
        self.requests: dict[tuple[str, str, str], int] = {}
        self.durations: dict[tuple[str, str], Hist] = {}
        self.highr = Hist(
            "http_request_duration_highr_seconds",
            "Latency with many buckets but no API specific labels. Made for more accurate "
            "percentile calculations.",
            _HIGHR_BUCKETS,
        )
        # handler -> [requests, request bytes, response bytes]
        self.sizes: dict[str, list[int]] = {}

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        path, root = scope["path"], scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :]
        handler = self.routes.handler(path)
        status = 500
        sent = 0

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal status, sent
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body":
                sent += len(message.get("body", b""))
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            self._record(scope, handler, status, sent, time.perf_counter() - start)

    def _record(
        self, scope: dict[str, Any], handler: str, status: int, sent: int, took: float
    ) -> None:
        method = method_label(scope["method"])
        key = (handler, method, f"{status // 100}xx")
        self.requests[key] = self.requests.get(key, 0) + 1
        hist = self.durations.get((handler, method))
        if hist is None:
            hist = self.durations[(handler, method)] = Hist(
                "http_request_duration_seconds",
                "Latency with only few buckets by handler.",
                _DURATION_BUCKETS,
            )
        hist.observe(took)
        self.highr.observe(took)
        size = self.sizes.setdefault(handler, [0, 0, 0])
        size[0] += 1
        size[1] += _content_length(scope)
        size[2] += sent

    def collect(self) -> Iterable[Metric]:
        total = CounterMetricFamily(
            "http_requests",
            "Total number of requests by method, status and handler.",
            labels=["handler", "method", "status"],
        )
        for labels, count in self.requests.items():
            total.add_metric(list(labels), float(count))
        yield total
        durations = None
        for (handler, method), hist in self.durations.items():
            fam = hist.family([handler, method], ["handler", "method"])
            if durations is None:
                durations = fam
            else:
                durations.samples += fam.samples
        if durations is not None:
            yield durations
        yield self.highr.family([], [])
        for name, doc, index in (
            ("http_request_size_bytes", "Content length of incoming requests by handler.", 1),
            ("http_response_size_bytes", "Content length of outgoing responses by handler.", 2),
        ):
            summary = SummaryMetricFamily(
                name, doc + " Only value of header is respected.", labels=["handler"]
            )
            for handler, size in self.sizes.items():
                summary.add_metric([handler], count_value=size[0], sum_value=size[index])
            yield summary


def _content_length(scope: dict[str, Any]) -> int:
    for name, value in scope["headers"]:
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return 0
    return 0
