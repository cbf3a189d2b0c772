"""vLLM's KV offload series (its ``OffloadingConnector``'s, ``--kv-offloading-size``): what the
tier's transfers moved, per engine core, over every rank.

``vllm:kv_offload_load_bytes_total`` / ``vllm:kv_offload_store_bytes_total``: bytes loaded from
the tier into the KV cache / stored from the KV cache into it; ``vllm:kv_offload_load_size`` /
``vllm:kv_offload_store_size``: histograms of each operation's bytes, one observation per rank
and request per step (vLLM's worker transfer jobs, each worker's own). vLLM's earlier names,
which it still exposes, carry the same figures by ``transfer_type`` ("CPU_to_GPU" for loads,
"GPU_to_CPU" for stores): ``vllm:kv_offload_total_bytes_total`` and ``vllm:kv_offload_size``.
A load is counted when the step that performs it is built.
``vllm:kv_offload_load_time_total`` / ``vllm:kv_offload_store_time_total`` (and the older
``vllm:kv_offload_total_time_total`` by ``transfer_type``): the copies' seconds, each rank's
measured in its worker and summed over the ranks, as vLLM sums its workers'.

Not exposed: ``vllm:kv_offload_stores_skipped`` (stores below a reuse threshold: trillm stores
every computed block, as vLLM's default)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from trillm.messages import KV_OFFLOAD_SIZE_BUCKETS, TransferSizes

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine

LABELS = ["model_name", "engine"]
_DIRECTIONS = (
    ("load", "loads", "CPU_to_GPU", "Total bytes loaded from offload storage to GPU."),
    ("store", "stores", "GPU_to_CPU", "Total bytes stored from GPU to offload storage."),
)


def _buckets(sizes: TransferSizes) -> list[tuple[str, float]]:
    pairs = [(str(bound), float(n)) for bound, n in zip(KV_OFFLOAD_SIZE_BUCKETS, sizes.buckets)]
    return [*pairs, ("+Inf", float(sizes.count))]


class KVOffloadCollector(Collector):
    """The series at scrape time; absent without the offload tier."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        per_engine = [
            ([self.model_name, str(i)], stats.kv_offload)
            for i, stats in enumerate(self.engine.get_engine_stats())
            if stats.kv_offload is not None
        ]
        if not per_engine:
            return
        total = CounterMetricFamily(
            "vllm:kv_offload_total_bytes",
            "Number of bytes offloaded by KV connector",
            labels=[*LABELS, "transfer_type"],
        )
        total_time = CounterMetricFamily(
            "vllm:kv_offload_total_time",
            "Total time measured by all KV offloading operations",
            labels=[*LABELS, "transfer_type"],
        )
        size = HistogramMetricFamily(
            "vllm:kv_offload_size",
            "Histogram of KV offload transfer size, in bytes.",
            labels=[*LABELS, "transfer_type"],
        )
        for name, attr, transfer_type, doc in _DIRECTIONS:
            counter = CounterMetricFamily(f"vllm:kv_offload_{name}_bytes", doc, labels=LABELS)
            seconds = CounterMetricFamily(
                f"vllm:kv_offload_{name}_time",
                f"Total {name} time of the KV offload tier's copies, in seconds.",
                labels=LABELS,
            )
            hist = HistogramMetricFamily(
                f"vllm:kv_offload_{name}_size",
                f"Histogram of KV offload {name} operation size, in bytes.",
                labels=LABELS,
            )
            for labels, stats in per_engine:
                sizes: TransferSizes = getattr(stats, attr)
                counter.add_metric(labels, float(sizes.bytes))
                seconds.add_metric(labels, sizes.seconds)
                total_time.add_metric([*labels, transfer_type], sizes.seconds)
                hist.add_metric(labels, _buckets(sizes), float(sizes.bytes))
                total.add_metric([*labels, transfer_type], float(sizes.bytes))
                size.add_metric([*labels, transfer_type], _buckets(sizes), float(sizes.bytes))
            yield counter
            yield seconds
            yield hist
        yield total
        yield total_time
        yield size
