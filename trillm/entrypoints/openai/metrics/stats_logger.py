"""The periodic stats line (vLLM's LoggingStatLogger), every ``--log-stats-interval`` seconds
unless ``--disable-log-stats``::

    Engine 000: Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 96.0
    tokens/s, Running: 4 reqs, Waiting: 0 reqs, KV cache usage: 12.5%, Prefix cache hit
    rate: 41.0%

As vLLM: logged at INFO when this interval or the previous one had tokens, at DEBUG on an
idle server (no noise). Throughputs count the tokens the frontend saw in the interval (prompt
tokens when their prefill completed); the hit rate is over the prompt tokens looked up in the
cache in the last ``HIT_RATE_WINDOW`` intervals.
"""

from __future__ import annotations

import logging
from collections import deque
from typing import TYPE_CHECKING

import trio

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine
    from trillm.entrypoints.openai.metrics.prometheus import ServerMetrics

logger = logging.getLogger("trillm.stats")

HIT_RATE_WINDOW = 6  # intervals (one minute at the default 10 s)


class StatsLine:
    def __init__(self, engine: AsyncEngine, metrics: ServerMetrics, now: float) -> None:
        self.engine = engine
        self.metrics = metrics
        self.last_time = now
        self.last_prompt, self.last_generation = metrics.token_totals()
        self.last_throughputs = (0.0, 0.0)
        stats = engine.get_stats()
        self.last_cache = (stats.prefix_cache_queries, stats.prefix_cache_hits)
        self.cache_window: deque[tuple[int, int]] = deque(maxlen=HIT_RATE_WINDOW)

    def line(self, now: float) -> tuple[int, str]:
        """The (level, message) for the interval ending at ``now``."""
        m = self.metrics
        elapsed = max(now - self.last_time, 1e-9)
        prompt_total, generation_total = m.token_totals()
        prompt = (prompt_total - self.last_prompt) / elapsed
        generation = (generation_total - self.last_generation) / elapsed
        self.last_time = now
        self.last_prompt, self.last_generation = prompt_total, generation_total
        stats = self.engine.get_stats()
        queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
        self.cache_window.append((queries - self.last_cache[0], hits - self.last_cache[1]))
        self.last_cache = (queries, hits)
        window_queries = sum(q for q, _ in self.cache_window)
        hit_rate = sum(h for _, h in self.cache_window) / window_queries if window_queries else 0
        active = any((prompt, generation, *self.last_throughputs))
        self.last_throughputs = (prompt, generation)
        message = (
            f"{self._engines()}: Avg prompt throughput: {prompt:.1f} tokens/s, "
            f"Avg generation throughput: {generation:.1f} tokens/s, "
            f"Running: {stats.num_running_reqs} reqs, Waiting: {stats.num_waiting_reqs} reqs, "
            f"KV cache usage: {stats.kv_cache_usage * 100:.1f}%, "
            f"Prefix cache hit rate: {hit_rate * 100:.1f}%"
        )
        return (logging.INFO if active else logging.DEBUG), message

    def _engines(self) -> str:
        """vLLM's "Engine 000"; with data parallelism the figures are summed over the cores
        (KV usage: their mean), and the line says so."""
        size = self.engine.data_parallel_size
        return "Engine 000" if size == 1 else f"Engines 000-{size - 1:03d}"


async def log_stats_periodically(
    engine: AsyncEngine, metrics: ServerMetrics, interval: float, stop: trio.Event
) -> None:
    """Until ``stop`` is set (the server stops serving): one line per interval."""
    stats = StatsLine(engine, metrics, trio.current_time())
    while True:
        with trio.move_on_after(interval):
            await stop.wait()
        if stop.is_set():
            return
        level, message = stats.line(trio.current_time())
        logger.log(level, message)
