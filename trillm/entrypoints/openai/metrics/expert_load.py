"""``trillm:expert_parallel_routed_tokens_total``: with ``--enable-expert-parallel``, the
(token, expert) pairs the router sent to each rank's experts, summed over the MoE layers, per
engine core and rank (``trillm/distributed/expert_parallel.py`` counts them; the output rank
sends each step's with its output). A rank whose count grows faster than the others' holds the
busier experts. vLLM exposes no such series (its load balancer logs a balancedness figure), so
this is trillm's own, under the ``trillm:`` prefix only."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine


class ExpertLoadCollector(Collector):
    """The series at scrape time; absent without expert parallelism."""

    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterable[Metric]:
        per_engine = self.engine.get_engine_stats()
        if not any(stats.expert_load for stats in per_engine):
            return
        family = CounterMetricFamily(
            "trillm:expert_parallel_routed_tokens",
            "Expert parallelism: (token, expert) pairs routed to each rank's experts, summed "
            "over the mixture-of-experts layers.",
            labels=["model_name", "engine", "rank"],
        )
        for index, stats in enumerate(per_engine):
            for rank, pairs in enumerate(stats.expert_load):
                family.add_metric([self.model_name, str(index), str(rank)], float(pairs))
        yield family
