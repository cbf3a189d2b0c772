"""Prometheus metrics, vLLM's names with a ``trillm:`` prefix, in a per-app registry.

Scheduler gauges (running, waiting, KV usage) and the prefix-cache counters are read from
``engine.get_stats()`` at scrape time; request-level histograms and counters are recorded by
the serving code as requests progress.
"""

from __future__ import annotations

from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    disable_created_metrics,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_LATENCY_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip


class _SchedulerCollector(Collector):
    def __init__(self, engine: Any, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Any:
        stats = self.engine.get_stats()
        label = [self.model_name]
        gauges = (
            ("trillm:num_requests_running", "Requests in the running batch.", "num_running_reqs"),
            (
                "trillm:num_requests_waiting",
                "Requests waiting to be scheduled.",
                "num_waiting_reqs",
            ),
            ("trillm:kv_cache_usage_perc", "KV-cache usage, 1 = full.", "kv_cache_usage"),
        )
        for name, doc, attr in gauges:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric(label, float(getattr(stats, attr)))
            yield g
        counters = (
            ("trillm:prefix_cache_queries", "Prompt tokens looked up.", "prefix_cache_queries"),
            ("trillm:prefix_cache_hits", "Prompt tokens found in the cache.", "prefix_cache_hits"),
            (
                "trillm:num_preemptions",
                "Requests preempted because the KV cache was full (recomputed later).",
                "num_preemptions",
            ),
        )
        for name, doc, attr in counters:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric(label, float(getattr(stats, attr)))
            yield c


class ServerMetrics:
    """The metrics of one app; ``render()`` is the /metrics body."""

    def __init__(self, engine: Any, model_name: str) -> None:
        disable_created_metrics()  # no *_created series (vLLM drops them too)
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_SchedulerCollector(engine, model_name))
        labels = ["model_name"]
        reg = self.registry

        def hist(name: str, doc: str) -> Any:
            return Histogram(name, doc, labels, registry=reg, buckets=_LATENCY_BUCKETS)

        self.ttft = hist("trillm:time_to_first_token_seconds", "Time to first token.").labels(
            model_name
        )
        self.itl = hist("trillm:inter_token_latency_seconds", "Time between tokens.").labels(
            model_name
        )
        self.e2e = hist("trillm:e2e_request_latency_seconds", "Request latency.").labels(model_name)
        self.prompt_tokens = Counter(
            "trillm:prompt_tokens", "Prompt tokens processed.", labels, registry=reg
        ).labels(model_name)
        self.generation_tokens = Counter(
            "trillm:generation_tokens", "Tokens generated.", labels, registry=reg
        ).labels(model_name)
        self._success = Counter(
            "trillm:request_success",
            "Finished requests, by finish reason.",
            labels + ["finished_reason"],
            registry=reg,
        )
        self._success_by_reason = {
            r: self._success.labels(model_name, r) for r in ("stop", "length", "abort")
        }

    def request_finished(self, reason: str) -> None:
        counter = self._success_by_reason.get(reason)
        if counter is None:
            counter = self._success_by_reason[reason] = self._success.labels(
                self.model_name, reason
            )
        counter.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


class RequestTimer:
    """Per-request latency bookkeeping: TTFT, inter-token latency, end-to-end."""

    __slots__ = ("metrics", "start", "last", "num_generated")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.last: float | None = None
        self.num_generated = 0

    def tokens(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.last is None:
            self.metrics.ttft.observe(now - self.start)
        else:
            self.metrics.itl.observe(now - self.last)
        self.last = now
        self.num_generated += count

    def finished(self, now: float, prompt_tokens: int, reasons: list[str]) -> None:
        m = self.metrics
        m.e2e.observe(now - self.start)
        m.prompt_tokens.inc(prompt_tokens)
        m.generation_tokens.inc(self.num_generated)
        for reason in reasons:
            m.request_finished(reason)
