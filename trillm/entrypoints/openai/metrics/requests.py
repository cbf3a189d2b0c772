"""The request series of /metrics, one set per engine core, and how a request records them.

vLLM records its request series (latencies, token counts, finish reasons, request
parameters) per engine core; so does trillm: each engine request (a prompt's sample) is
counted under the core that ran it, which its outputs name (``RequestMetrics.engine_index``,
set when the router picks the core). With one core everything is engine "0".

``RequestTimer`` follows one HTTP request: ``output`` sees each RequestOutput (one prompt's
delta), ``finished`` ends the request. A sample that never produced an output (aborted
before its first token: a client gone, a shutdown) counts under the core of the request's
other samples, engine "0" when none produced one (its core is not known to the frontend).

Plain counters (``Hist``, ``Count``), not prometheus_client's locked ones: everything is
recorded on the one Trio thread, per streamed output.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.utils import floatToGoString

from trillm.entrypoints.openai.metrics.sample_times import SampleTimes, sample_times

if TYPE_CHECKING:
    from trillm.outputs import RequestOutput

LABELS = ["model_name", "engine"]

# vLLM's buckets (vllm/v1/metrics/loggers.py).
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
_TOKEN_LATENCY_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_REQUEST_LATENCY_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
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


class RequestSeries:
    """One engine core's request series."""

    def __init__(self, length_buckets: list[int]) -> None:
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
            "vllm:request_generation_tokens",
            "Number of generation tokens processed.",
            length_buckets,
        )
        self.params_n = hist(
            "vllm:request_params_n", "Histogram of the n request parameter.", _N_BUCKETS
        )
        self.params_max_tokens = hist(
            "vllm:request_params_max_tokens",
            "Histogram of the max_tokens request parameter.",
            length_buckets,
        )
        self.ttft = hist(
            "vllm:time_to_first_token_seconds",
            "Histogram of time to first token in seconds.",
            _TTFT_BUCKETS,
        )
        self.itl = hist(
            "vllm:inter_token_latency_seconds",
            "Histogram of inter-token latency in seconds.",
            _TOKEN_LATENCY_BUCKETS,
        )
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
        self.decode = phase(
            "vllm:request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
        )

    def request_finished(self, reason: str) -> None:
        self.success[reason] = self.success.get(reason, 0) + 1

    def request_params(self, n: int, max_tokens: int | None) -> None:
        """One prompt's n and max_tokens (when the request set one), as vLLM."""
        self.params_n.observe(n)
        if max_tokens is not None:
            self.params_max_tokens.observe(max_tokens)


class Sample:
    """One engine request as the frontend sees it: a prompt's sample."""

    __slots__ = ("series", "prompt_len", "first", "last", "count", "done")

    def __init__(self, series: RequestSeries, prompt_len: int) -> None:
        self.series = series  # its engine core's
        self.prompt_len = prompt_len
        self.first: float | None = None  # time.perf_counter of its first token
        self.last: float | None = None  # ... and of its latest
        self.count = 0
        self.done = False


def request_families(per_engine: list[RequestSeries], model_name: str) -> Iterable[Metric]:
    """Each request series as one family with a sample per engine core."""
    labels = [[model_name, str(index)] for index in range(len(per_engine))]
    for attr in ("prompt_tokens", "generation_tokens"):
        counts: list[Count] = [getattr(s, attr) for s in per_engine]
        yield merged_families([c.family(values) for c, values in zip(counts, labels)])
    fam = CounterMetricFamily(
        "vllm:request_success",
        "Count of successfully processed requests (engine requests, by finish reason).",
        labels=LABELS + ["finished_reason"],
    )
    for series, values in zip(per_engine, labels):
        for reason, count in series.success.items():
            fam.add_metric([*values, reason], float(count))
    yield fam
    for i in range(len(per_engine[0].histograms)):
        yield merged_families(
            [s.histograms[i].family(values) for s, values in zip(per_engine, labels)]
        )


def merged_families(families: list[Metric]) -> Metric:
    """The first family with the others' samples (the same series, other engine cores)."""
    fam = families[0]
    for other in families[1:]:
        fam.samples += other.samples
    return fam


class RequestTimer:
    """One HTTP request's series, recorded per engine request (prompt x sample) under the
    engine core that ran it: TTFT, inter-token latency, token counts as they arrive; e2e,
    lengths, decode time, TPOT and the finish reason when each sample ends; ``n`` and
    ``max_tokens`` once per prompt (``params``: (n, max_tokens, prompts), None: not
    recorded)."""

    __slots__ = ("per_engine", "start", "samples", "ended", "params", "jobs", "on_end")

    def __init__(
        self,
        per_engine: list[RequestSeries],
        start: float,
        params: tuple[int, int | None, int] | None = None,
    ) -> None:
        self.per_engine = per_engine
        self.start = start
        self.samples: dict[tuple[int, int], Sample] = {}
        self.ended = 0
        self.params = params
        self.jobs: set[int] = set()  # prompts whose request_params are recorded
        # Told of each sample that ends on its own: its figures, last output and choice index
        # (a request's trace span, metrics/tracing.py).
        self.on_end: Callable[[SampleTimes, RequestOutput, int], None] | None = None

    def _series(self, out: RequestOutput) -> RequestSeries:
        index = out.metrics.engine_index if out.metrics is not None else 0
        return self.per_engine[index if 0 <= index < len(self.per_engine) else 0]

    def output(self, now: float, out: RequestOutput, job: int = 0) -> None:
        """A RequestOutput (one prompt's delta) read at ``now`` (``time.perf_counter``)."""
        m = self._series(out)
        if job not in self.jobs:
            self._record_params(job, m)
        for c in out.outputs:
            key = (job, c.index)
            s = self.samples.get(key)
            if s is None:
                s = self.samples[key] = Sample(m, len(out.prompt_token_ids or ()))
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
                self._end(now, s, str(c.finish_reason), out, c.index)

    def _record_params(self, job: int, series: RequestSeries) -> None:
        self.jobs.add(job)
        if self.params is not None:
            series.request_params(self.params[0], self.params[1])

    def _end(
        self, now: float, s: Sample, reason: str, out: RequestOutput | None = None, index: int = 0
    ) -> None:
        m = s.series
        s.done = True
        self.ended += 1
        m.request_finished(reason)
        t = sample_times(self.start, now, s, out)
        m.e2e.observe(t.e2e)
        m.request_prompt_tokens.observe(t.prompt_tokens)
        m.request_generation_tokens.observe(t.completion_tokens)
        if t.decode is not None:
            m.decode.observe(t.decode)
            if s.count > 1:
                m.tpot.observe(t.decode / (s.count - 1))
        for hist, value in ((m.queue, t.queue), (m.prefill, t.prefill), (m.inference, t.inference)):
            if value is not None:
                hist.observe(value)
        if self.on_end is not None and out is not None:
            self.on_end(t, out, index)

    def finished(self, now: float, prompt_tokens: int, reasons: list[str]) -> None:
        """The HTTP request is over (``reasons``: one per sample, "abort" for those cut
        short): samples that did not end on their own (a client gone, a shutdown) end as
        aborted, those that never produced an output too."""
        fallback = next(iter(self.samples.values())).series if self.samples else None
        fallback = fallback or self.per_engine[0]
        if self.params is not None:
            for job in range(self.params[2]):
                if job not in self.jobs:
                    self._record_params(job, fallback)
        for s in self.samples.values():
            if not s.done:
                self._end(now, s, "abort")
        for _ in range(len(reasons) - self.ended):
            self._end(now, Sample(fallback, 0), "abort")
