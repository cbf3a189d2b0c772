"""Prometheus metrics: vLLM v1's series, under ``vllm:`` and ``trillm:`` names, per app.

Every series carries vLLM's labels ``model_name`` and ``engine``. The engine-scoped series
(scheduler gauges and counters, ``cache_config_info``, ``iteration_tokens_total``) have one
sample per engine core, ``engine`` "0" .. "K-1" with ``--data-parallel-size K``; the request
series are measured at the one frontend and carry ``engine`` "0".
``--metrics-prefix`` picks the names: ``both`` (default: vLLM's dashboards and trillm's own
work unchanged), ``vllm`` or ``trillm``. The series are recorded once, under ``vllm:``, and
renamed at scrape time, so a second prefix costs nothing per request.

Sources:
- scheduler gauges (running, waiting, KV usage), the prefix-cache and preemption counters,
  ``cache_config_info`` and (with --enable-lora) ``lora_requests_info`` are read from the
  engine at scrape time; ``lora_requests_info`` has vLLM's labels only (``max_lora``,
  ``waiting_lora_adapters``, ``running_lora_adapters``), summed over the engine cores;
- request series are recorded per engine request (each sample of an ``n > 1`` request, each
  prompt of a batched completion), as vLLM does, so ``request_success_total`` and the latency
  and length histograms count the same things: ``RequestTimer.output`` sees each output,
  ``RequestTimer.finished`` ends the HTTP request;
- ``request_params_n`` / ``request_params_max_tokens`` once per prompt, from the request body.

The queue / prefill / inference intervals come from the engine's first P1 time of each
request (``RequestMetrics.first_scheduled_time``, carried by its first output);
``iteration_tokens_total`` observes each engine step's computed-token count
(``AsyncEngine.step_observers``). Request series are plain counters (``Hist``, ``Count``), not
prometheus_client's locked ones: they are recorded on the one Trio thread, per streamed output.
"""

from __future__ import annotations

import time
from bisect import bisect_left
from collections.abc import Iterable
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    GCCollector,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
PREFIXES = {"both": ("vllm:", "trillm:"), "vllm": ("vllm:",), "trillm": ("trillm:",)}
ENGINE_INDEX = "0"
LABELS = ["model_name", "engine"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
_TOKEN_LATENCY_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
_REQUEST_LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
_N_BUCKETS = (1, 2, 5, 10, 20)


def buckets_1_2_5(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to ``limit`` (vLLM's build_1_2_5_buckets)."""
    out: list[int] = []
    exponent = 0
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * 10**exponent
            if value > limit:
                return out
            out.append(value)
        exponent += 1


class _SchedulerCollector(Collector):
    """What the engine knows at scrape time."""

    def __init__(self, engine: Any, labels: list[str]) -> None:
        self.engine = engine
        self.labels = labels

    def collect(self) -> Iterable[Metric]:
        per_engine = engine_stats(self.engine)
        labels = [[self.labels[0], str(i)] for i in range(len(per_engine))]
        gauges = (
            ("vllm:num_requests_running", "Number of requests in model execution batches.",
             "num_running_reqs"),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.",
             "num_waiting_reqs"),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.",
             "kv_cache_usage"),
        )  # fmt: skip
        yield from _stat_families(GaugeMetricFamily, gauges, list(zip(labels, per_engine)))
        counters = (
            ("vllm:prefix_cache_queries",
             "Prefix cache queries, in terms of number of queried tokens.",
             "prefix_cache_queries"),
            ("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
             "prefix_cache_hits"),
            ("vllm:num_preemptions",
             "Cumulative number of preemption from the engine (recomputed later).",
             "num_preemptions"),
        )  # fmt: skip
        yield from _stat_families(CounterMetricFamily, counters, list(zip(labels, per_engine)))
        specs = [(values, s.spec_decoding) for values, s in zip(labels, per_engine)
                 if s.spec_decoding is not None]  # fmt: skip
        if specs:
            yield from self._spec_decoding(specs)
        lora = getattr(getattr(self.engine, "config", None), "lora", None)
        if lora is not None:
            yield lora_requests_info(lora.max_loras, self.engine.get_stats())
        infos = [cache_config_info(self.engine, index) for index in range(len(per_engine))]
        g = GaugeMetricFamily(
            "vllm:cache_config_info", "Information of the LLMEngine CacheConfig",
            labels=list(infos[0]),
        )  # fmt: skip
        for info in infos:
            g.add_metric(list(info.values()), 1.0)
        yield g

    def _spec_decoding(self, specs: list[tuple[list[str], Any]]) -> Iterable[Metric]:
        """vLLM v1's speculative-decoding counters (only with a speculative_config)."""
        counters = (
            ("vllm:spec_decode_num_drafts", "Number of spec decoding drafts.", "num_drafts"),
            ("vllm:spec_decode_num_draft_tokens", "Number of draft tokens.",
             "num_draft_tokens"),
            ("vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens.",
             "num_accepted_tokens"),
        )  # fmt: skip
        yield from _stat_families(CounterMetricFamily, counters, specs)
        per_pos = CounterMetricFamily(
            "vllm:spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.", labels=[*LABELS, "position"],
        )  # fmt: skip
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


def engine_stats(engine: Any) -> list[Any]:
    """Each engine core's scheduler stats (one core: the engine's stats)."""
    per_engine = getattr(engine, "get_engine_stats", None)
    return per_engine() if per_engine is not None else [engine.get_stats()]


def lora_requests_info(max_loras: int, stats: Any) -> Metric:
    """vLLM's ``lora_requests_info`` (with --enable-lora): its labels name the adapters with
    running and waiting requests (comma-separated) and max_lora; its value is the time of the
    stats (vLLM: ``set_to_current_time``), here the scrape's."""
    g = GaugeMetricFamily(
        "vllm:lora_requests_info", "Running stats on lora requests.",
        labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
    )  # fmt: skip
    waiting = ",".join(stats.waiting_lora_adapters)
    running = ",".join(stats.running_lora_adapters)
    g.add_metric([str(max_loras), waiting, running], time.time())
    return g


def cache_config_info(engine: Any, index: int = 0) -> dict[str, str]:
    """vLLM's cache_config_info labels (the fields trillm has), plus ``engine``: of engine
    core ``index``."""
    cache = getattr(getattr(engine, "config", None), "cache", None)
    info = {"engine": str(index), "cache_dtype": "auto"}
    for name in ("block_size", "enable_prefix_caching", "gpu_memory_utilization",
                 "num_gpu_blocks_override", "kv_cache_memory"):  # fmt: skip
        info[name] = str(getattr(cache, name, None))
    executors = getattr(engine, "executors", None)
    blocks = executors[index].num_blocks if executors else getattr(engine, "num_blocks", None)
    info["num_gpu_blocks"] = str(blocks)
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


class Hist:
    """A histogram without prometheus_client's lock: every observation comes from the one
    Trio thread, and an observation is on the hot path of every streamed chunk."""

    __slots__ = ("name", "doc", "bounds", "counts", "sum")

    def __init__(self, name: str, doc: str, bounds: Iterable[float]) -> None:
        self.name = name
        self.doc = doc
        self.bounds = [float(b) for b in bounds]
        self.counts = [0] * (len(self.bounds) + 1)  # per bucket (le), the last: +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.sum += value

    def family(self, labels: list[str], names: list[str] | None = None) -> Metric:
        fam = HistogramMetricFamily(self.name, self.doc, labels=LABELS if names is None else names)
        buckets, total = [], 0
        for bound, count in zip(self.bounds, self.counts, strict=False):
            total += count
            buckets.append((floatToGoString(bound), total))
        buckets.append(("+Inf", total + self.counts[-1]))
        fam.add_metric(labels, buckets, self.sum)
        return fam


class Count:
    """A counter, lock-free as ``Hist``."""

    __slots__ = ("name", "doc", "value")

    def __init__(self, name: str, doc: str) -> None:
        self.name = name
        self.doc = doc
        self.value = 0

    def inc(self, amount: int = 1) -> None:
        self.value += amount

    def family(self, labels: list[str]) -> Metric:
        fam = CounterMetricFamily(self.name, self.doc, labels=LABELS)
        fam.add_metric(labels, float(self.value))
        return fam


class _RequestCollector(Collector):
    """The request series, exposed at scrape time."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterable[Metric]:
        m = self.metrics
        yield m.prompt_tokens.family(m.labels)
        yield m.generation_tokens.family(m.labels)
        fam = CounterMetricFamily(
            "vllm:request_success",
            "Count of successfully processed requests (engine requests, by finish reason).",
            labels=LABELS + ["finished_reason"],
        )
        for reason, count in m.success.items():
            fam.add_metric([*m.labels, reason], float(count))
        yield fam
        for hist in m.histograms:
            yield hist.family(m.labels)
        yield from _per_engine_family(m.iteration_tokens, m.labels[0])


def _per_engine_family(hists: list[Hist], model_name: str) -> Iterable[Metric]:
    """One histogram family with a sample per engine core."""
    fam = hists[0].family([model_name, "0"])
    for index, hist in enumerate(hists[1:], start=1):
        fam.samples += hist.family([model_name, str(index)]).samples
    yield fam


class ServerMetrics:
    """The metrics of one app; ``render()`` is the /metrics body."""

    def __init__(
        self, engine: Any, model_name: str, prefix: str = "both", max_model_len: int | None = None
    ) -> None:
        self.model_name = model_name
        self.labels = [model_name, ENGINE_INDEX]
        self.base = CollectorRegistry(auto_describe=False)
        self.base.register(_SchedulerCollector(engine, self.labels))
        self.base.register(_RequestCollector(self))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Renamed(self.base, PREFIXES[prefix]))
        # process_* / python_* as vLLM exposes them (prometheus_client's defaults).
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        if max_model_len is None:
            max_model_len = getattr(getattr(engine, "model_config", None), "max_model_len", 0)
        length_buckets = buckets_1_2_5(max(int(max_model_len or 0), 1))
        sched = getattr(getattr(engine, "config", None), "scheduler", None)
        step_tokens = int(getattr(sched, "max_num_batched_tokens", 0) or 8192)
        self.histograms: list[Hist] = []

        def hist(name: str, doc: str, buckets: Iterable[float]) -> Hist:
            h = Hist(name, doc, buckets)
            self.histograms.append(h)
            return h

        self.prompt_tokens = Count("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = Count(
            "vllm:generation_tokens", "Number of generation tokens processed."
        )
        # finished_reason -> engine requests (vLLM lists its reasons even at 0).
        self.success: dict[str, int] = {"stop": 0, "length": 0, "abort": 0}
        self.request_prompt_tokens = hist(
            "vllm:request_prompt_tokens", "Number of prefill tokens processed.", length_buckets
        )
        self.request_generation_tokens = hist(
            "vllm:request_generation_tokens", "Number of generation tokens processed.",
            length_buckets,
        )  # fmt: skip
        # One per engine core (engine-scoped), observed with each step's core index.
        self.iteration_tokens = [
            Hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                 sorted(set(buckets_1_2_5(step_tokens) + [step_tokens])))
            for _ in range(int(getattr(engine, "data_parallel_size", 1)))
        ]  # fmt: skip
        observers = getattr(engine, "step_observers", None)
        if observers is not None:
            observers.append(self.observe_step)
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens", "Histogram of the max_tokens request parameter.",
            length_buckets,
        )  # fmt: skip
        self.ttft = hist(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )  # fmt: skip
        self.itl = hist(
            "vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
            _TOKEN_LATENCY_BUCKETS,
        )  # fmt: skip
        self.tpot = hist(
            "vllm:request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            _TOKEN_LATENCY_BUCKETS,
        )

        def phase(name: str, doc: str) -> Hist:
            return hist(name, doc, _REQUEST_LATENCY_BUCKETS)

        self.e2e = phase(
            "vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds."
        )
        self.queue = phase(
            "vllm:request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
        )
        self.inference = phase(
            "vllm:request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
        )
        self.prefill = phase(
            "vllm:request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
        )
        self.decode = phase("vllm:request_decode_time_seconds",
                            "Histogram of time spent in DECODE phase for request.")  # fmt: skip

    def observe_step(self, num_tokens: int, engine_index: int = 0) -> None:
        self.iteration_tokens[engine_index].observe(num_tokens)

    def request_finished(self, reason: str) -> None:
        self.success[reason] = self.success.get(reason, 0) + 1

    def request_params(self, n: int, max_tokens: int | None, prompts: int = 1) -> None:
        """The request's n and max_tokens (when it set one), once per prompt, as vLLM."""
        for _ in range(prompts):
            self.params_n.observe(n)
            if max_tokens is not None:
                self.params_max_tokens.observe(max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _scheduled_time(out: Any) -> float | None:
    """The engine's first SCHEDULED time of a request (``time.time()`` clock), if it has one."""
    return getattr(getattr(out, "metrics", None), "first_scheduled_time", None)


class _Sample:
    """One engine request as the frontend sees it: a prompt's sample."""

    __slots__ = ("prompt_len", "first", "last", "count", "done")

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len
        self.first: float | None = None
        self.last: float | None = None
        self.count = 0
        self.done = False


class RequestTimer:
    """One HTTP request's series, recorded per engine request (prompt x sample): TTFT,
    inter-token latency, token counts as they arrive; e2e, lengths, decode time, TPOT and
    the finish reason when each sample ends."""

    __slots__ = ("metrics", "start", "samples", "ended")

    def __init__(self, metrics: ServerMetrics, start: float) -> None:
        self.metrics = metrics
        self.start = start
        self.samples: dict[tuple[int, int], _Sample] = {}
        self.ended = 0

    def output(self, now: float, out: Any, job: int = 0) -> None:
        """A RequestOutput (one prompt's delta) read at ``now`` (``time.perf_counter``)."""
        m = self.metrics
        for c in out.outputs:
            key = (job, c.index)
            s = self.samples.get(key)
            if s is None:
                s = self.samples[key] = _Sample(len(out.prompt_token_ids or ()))
            n = len(c.token_ids)
            if n:
                m.generation_tokens.value += n
                if s.last is None:  # the prefill is done: vLLM counts its tokens now
                    s.first = now
                    m.ttft.observe(now - self.start)
                    m.prompt_tokens.value += s.prompt_len
                else:
                    # Tokens merged into one delta (--stream-interval, a slow reader) shared
                    # the gap since the previous one.
                    gap = (now - s.last) / n
                    for _ in range(n):
                        m.itl.observe(gap)
                s.last = now
                s.count += n
            if c.finish_reason is not None and not s.done:
                self._end(now, s, str(c.finish_reason), out)

    def _end(self, now: float, s: _Sample, reason: str, out: Any = None) -> None:
        m = self.metrics
        s.done = True
        self.ended += 1
        m.request_finished(reason)
        m.e2e.observe(now - self.start)
        m.request_prompt_tokens.observe(s.prompt_len)
        m.request_generation_tokens.observe(s.count)
        if s.first is not None and s.last is not None:
            decode = s.last - s.first
            m.decode.observe(decode)
            if s.count > 1:
                m.tpot.observe(decode / (s.count - 1))
        scheduled = _scheduled_time(out)
        times = getattr(out, "metrics", None)
        if scheduled is not None and times is not None:
            m.queue.observe(max(scheduled - times.arrival_time, 0.0))
            if times.first_token_time is not None:
                m.prefill.observe(max(times.first_token_time - scheduled, 0.0))
            if times.last_token_time is not None:
                m.inference.observe(max(times.last_token_time - scheduled, 0.0))

    def finished(self, now: float, prompt_tokens: int, reasons: list[str]) -> None:
        """The HTTP request is over (``reasons``: one per sample, "abort" for those cut
        short): samples that did not end on their own (a client gone, a shutdown) end as
        aborted, those that never produced an output too."""
        for s in self.samples.values():
            if not s.done:
                self._end(now, s, "abort")
        for _ in range(len(reasons) - self.ended):
            self._end(now, _Sample(0), "abort")
