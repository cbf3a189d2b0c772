"""Prometheus metrics: vLLM v1's series, under ``vllm:`` and ``trillm:`` names, per app.

Every series carries vLLM's labels ``model_name`` and ``engine``, and has one sample per
engine core, ``engine`` "0" .. "K-1" with ``--data-parallel-size K``: the engine-scoped series
(scheduler gauges and counters, ``cache_config_info``, ``iteration_tokens_total``) from each
core's stats, the request series (``metrics/requests.py``) under the core that ran the request.
``--metrics-prefix`` picks the names: ``both`` (default: vLLM's dashboards and trillm's own
work unchanged), ``vllm`` or ``trillm``. The series are recorded once, under ``vllm:``, and
renamed at scrape time, so a second prefix costs nothing per request.

Sources:
- scheduler gauges (running, waiting, KV usage), the prefix-cache and preemption counters,
  the multimodal processor cache's counters (``vllm:mm_cache_queries`` / ``_hits``),
  ``cache_config_info`` and (with --enable-lora) ``lora_requests_info`` are read from the
  engine at scrape time; ``lora_requests_info`` has vLLM's labels only (``max_lora``,
  ``waiting_lora_adapters``, ``running_lora_adapters``), summed over the engine cores;
- request series are recorded per engine request (each sample of an ``n > 1`` request, each
  prompt of a batched completion), as vLLM does, so ``request_success_total`` and the latency
  and length histograms count the same things: ``RequestTimer.output`` sees each output,
  ``RequestTimer.finished`` ends the HTTP request;
- ``request_params_n`` / ``request_params_max_tokens`` once per prompt, from the request body,
  under the core that ran the prompt.

The queue / prefill / inference intervals come from the engine's first P1 time of each
request (``RequestMetrics.first_scheduled_time``, carried by its first output);
``iteration_tokens_total`` observes each engine step's computed-token count
(``AsyncEngine.step_observers``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from trillm.entrypoints.openai.metrics.expert_load import ExpertLoadCollector
from trillm.entrypoints.openai.metrics.kv_offload import KVOffloadCollector
from trillm.entrypoints.openai.metrics.pooling import PoolingTimer
from trillm.entrypoints.openai.metrics.requests import (
    LABELS,
    Hist,
    RequestSeries,
    RequestTimer,
    buckets_1_2_5,
    merged_families,
    request_families,
)

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine
    from trillm.entrypoints.openai.metrics.tracing import RequestTrace
    from trillm.messages import SchedulerStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIXES = {"both": ("vllm:", "trillm:"), "vllm": ("vllm:",), "trillm": ("trillm:",)}


class _SchedulerCollector(Collector):
    """What the engine knows at scrape time."""

    def __init__(self, engine: AsyncEngine, labels: list[str]) -> None:
        self.engine = engine
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        per_engine = engine_stats(self.engine)
        labels = [[self.labels[0], str(i)] for i in range(len(per_engine))]
        gauges = (
            (
                "vllm:num_requests_running",
                "Number of requests in model execution batches.",
                "num_running_reqs",
            ),
            (
                "vllm:num_requests_waiting",
                "Number of requests waiting to be processed.",
                "num_waiting_reqs",
            ),
            (
                "vllm:kv_cache_usage_perc",
                "KV-cache usage. 1 means 100 percent usage.",
                "kv_cache_usage",
            ),
        )
        yield from _stat_families(GaugeMetricFamily, gauges, list(zip(labels, per_engine)))
        yield waiting_by_reason(list(zip(labels, per_engine)))
        counters = (
            (
                "vllm:prefix_cache_queries",
                "Prefix cache queries, in terms of number of queried tokens.",
                "prefix_cache_queries",
            ),
            (
                "vllm:prefix_cache_hits",
                "Prefix cache hits, in terms of number of cached tokens.",
                "prefix_cache_hits",
            ),
            (
                "vllm:external_prefix_cache_queries",
                "External prefix cache queries from KV connector cross-instance cache sharing, "
                "in terms of number of queried tokens.",
                "external_prefix_cache_queries",
            ),
            (
                "vllm:external_prefix_cache_hits",
                "External prefix cache hits from KV connector cross-instance cache sharing, "
                "in terms of number of cached tokens.",
                "external_prefix_cache_hits",
            ),
            (
                "vllm:num_preemptions",
                "Cumulative number of preemption from the engine (recomputed later).",
                "num_preemptions",
            ),
        )
        yield from _stat_families(CounterMetricFamily, counters, list(zip(labels, per_engine)))
        if any(s.prompt_tokens_by_source for s in per_engine):
            yield prompt_tokens_by_source(list(zip(labels, per_engine)))
        yield from _mm_cache_families(self.engine, labels[0])
        specs = [
            (values, s.spec_decoding)
            for values, s in zip(labels, per_engine)
            if s.spec_decoding is not None
        ]
        if specs:
            yield from self._spec_decoding(specs)
        lora = self.engine.config.lora
        if lora is not None:
            yield lora_requests_info(lora.max_loras, self.engine.get_stats())
        infos = [cache_config_info(self.engine, index) for index in range(len(per_engine))]
        g = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=list(infos[0]),
        )
        for info in infos:
            g.add_metric(list(info.values()), 1.0)
        yield g

    def _spec_decoding(self, specs: list[tuple[list[str], Any]]) -> Iterable[Metric]:
        """vLLM v1's speculative-decoding counters (only with a speculative_config)."""
        counters = (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.", "num_draft_tokens"),
            (
                "vllm:spec_decode_num_accepted_tokens",
                "Number of accepted tokens.",
                "num_accepted_tokens",
            ),
        )
        yield from _stat_families(CounterMetricFamily, counters, specs)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            labels=[*LABELS, "position"],
        )
        for values, spec in specs:
            for pos, count in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([*values, str(pos)], float(count))
        yield per_pos


def _stat_families(
    kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
    rows: Iterable[tuple[str, str, str]],
    per_engine: list[tuple[list[str], Any]],
) -> Iterable[Metric]:
    """A family per (name, documentation, attribute) row, a sample per engine core: that
    attribute of the core's stats, under the core's label values."""
    for name, doc, attr in rows:
        fam = kind(name, doc, labels=LABELS)
        for values, stats in per_engine:
            fam.add_metric(values, float(getattr(stats, attr)))
        yield fam


def waiting_by_reason(per_engine: list[tuple[list[str], Any]]) -> Metric:
    """vLLM's vllm:num_requests_waiting_by_reason: the waiting requests of each core, as
    ``deferred`` (held until their grammar compiles) and ``capacity`` (the rest: waiting for
    room in the batch or the KV cache)."""
    fam = GaugeMetricFamily(
        "vllm:num_requests_waiting_by_reason",
        "Number of requests waiting, by the reason they wait.",
        labels=[*LABELS, "reason"],
    )
    for values, stats in per_engine:
        deferred = stats.num_deferred_waiting_reqs
        fam.add_metric([*values, "capacity"], float(stats.num_waiting_reqs - deferred))
        fam.add_metric([*values, "deferred"], float(deferred))
    return fam


def prompt_tokens_by_source(per_engine: list[tuple[list[str], SchedulerStats]]) -> Metric:
    """vLLM's vllm:prompt_tokens_by_source: each request's prompt tokens once, as computed
    here, found in the local prefix cache, or loaded by the KV connector (the offload tier)."""
    fam = CounterMetricFamily(
        "vllm:prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        labels=[*LABELS, "source"],
    )
    for values, stats in per_engine:
        for source, count in stats.prompt_tokens_by_source.items():
            fam.add_metric([*values, source], float(count))
    return fam


def _mm_cache_families(engine: AsyncEngine, labels: list[str]) -> Iterable[Metric]:
    """vLLM's multimodal cache counters, in items: the frontend's processed-image cache
    (``--mm-processor-cache-gb``), one for all engine cores, so under the first core's labels;
    0 without one (a text-only model, a cache of 0 GiB), as vLLM always has the series."""
    cache = getattr(engine.preprocessor.multimodal, "cache", None)
    for name, doc, attr in (
        ("vllm:mm_cache_queries", "Multi-modal cache queries, in items.", "queries"),
        ("vllm:mm_cache_hits", "Multi-modal cache hits, in items.", "hits"),
    ):
        family = CounterMetricFamily(name, doc, labels=LABELS)
        family.add_metric(labels, float(0 if cache is None else getattr(cache, attr)))
        yield family


def engine_stats(engine: AsyncEngine) -> list[Any]:
    """Each engine core's scheduler stats (one core: the engine's stats)."""
    return engine.get_engine_stats()


def lora_requests_info(max_loras: int, stats: Any) -> Metric:
    """vLLM's ``lora_requests_info`` (with --enable-lora): its labels name the adapters with
    running and waiting requests (comma-separated) and max_lora; its value is the time of the
    stats (vLLM: ``set_to_current_time``), here the scrape's."""
    g = GaugeMetricFamily(
        "vllm:lora_requests_info",
        "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )
    waiting = ",".join(stats.waiting_lora_adapters)
    running = ",".join(stats.running_lora_adapters)
    g.add_metric([str(max_loras), waiting, running], time.time())
    return g


def cache_config_info(engine: AsyncEngine, index: int = 0) -> dict[str, str]:
    """vLLM's cache_config_info labels (the fields trillm has), plus ``engine``: of engine
    core ``index``."""
    cache = engine.config.cache
    info = {"engine": str(index), "cache_dtype": "auto"}
    for name in (
        "block_size",
        "enable_prefix_caching",
        "gpu_memory_utilization",
        "num_gpu_blocks_override",
        "kv_cache_memory",
    ):
        info[name] = str(getattr(cache, name))
    info["num_gpu_blocks"] = str(engine.executors[index].num_blocks)
    return info


class _Renamed(Collector):
    """The base registry's ``vllm:`` series under each prefix asked for."""

    def __init__(self, base: CollectorRegistry, prefixes: tuple[str, ...]) -> None:
        self.base = base
        self.prefixes = prefixes

    def collect(self) -> Iterable[Metric]:
        families = list(self.base.collect())
        for prefix in self.prefixes:
            for family in families:
                if prefix == "vllm:":
                    yield family
                    continue
                renamed = Metric(prefix + family.name[5:], family.documentation, family.type)
                renamed.samples = [s._replace(name=prefix + s.name[5:]) for s in family.samples]
                yield renamed


class _RequestCollector(Collector):
    """The request series, exposed at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        yield from request_families(m.per_engine, m.model_name)
        yield merged_families(
            [
                hist.family([m.model_name, str(index)])
                for index, hist in enumerate(m.iteration_tokens)
            ]
        )


class ServerMetrics:
    """The metrics of one app; ``render()`` is the /metrics body."""

    def __init__(
        self,
        engine: AsyncEngine,
        model_name: str,
        prefix: str = "both",
        max_model_len: int | None = None,
    ) -> None:
        self.model_name = model_name
        self.base = CollectorRegistry(auto_describe=False)
        self.base.register(_SchedulerCollector(engine, [model_name]))
        self.base.register(_RequestCollector(self))
        self.base.register(KVOffloadCollector(engine, model_name))  # with --kv-offloading-size
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Renamed(self.base, PREFIXES[prefix]))
        if "trillm:" in PREFIXES[prefix]:  # trillm's own series (no vLLM name to mirror)
            self.registry.register(ExpertLoadCollector(engine, model_name))
        # process_* / python_* as vLLM exposes them (prometheus_client's defaults).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        if max_model_len is None:
            max_model_len = engine.model_config.max_model_len
        length_buckets = buckets_1_2_5(max(max_model_len, 1))
        step_tokens = engine.config.scheduler.max_num_batched_tokens
        cores = engine.data_parallel_size
        # The request series, one set per engine core (metrics/requests.py).
        self.per_engine = [RequestSeries(length_buckets) for _ in range(cores)]
        # One per engine core (engine-scoped), observed with each step's core index.
        self.iteration_tokens = [
            Hist(
                "vllm:iteration_tokens_total",
                "Histogram of number of tokens per engine_step.",
                sorted(set(buckets_1_2_5(step_tokens) + [step_tokens])),
            )
            for _ in range(cores)
        ]
        engine.step_observers.append(self.observe_step)

    def observe_step(self, num_tokens: int, engine_index: int = 0) -> None:
        self.iteration_tokens[engine_index].observe(num_tokens)

    def token_totals(self) -> tuple[int, int]:
        """(prompt, generation) tokens so far, over the engine cores."""
        return (
            sum(s.prompt_tokens.value for s in self.per_engine),
            sum(s.generation_tokens.value for s in self.per_engine),
        )

    def timer(
        self, start: float, params: tuple[int, int | None, int] | None = None
    ) -> RequestTimer:
        """A RequestTimer for one HTTP request started at ``start`` (``time.perf_counter``);
        ``params``: its (n, max_tokens, prompts) for request_params_*."""
        return RequestTimer(self.per_engine, start, params)

    def pooling_timer(self, inputs: int, trace: RequestTrace | None) -> PoolingTimer:
        """A PoolingTimer for one pooling request of ``inputs`` engine requests, started now;
        ``trace``: its span maker (--otlp-traces-endpoint), else None."""
        return PoolingTimer(self.per_engine, inputs, trace)

    def render(self) -> bytes:
        return generate_latest(self.registry)
