"""``ModelRunner`` whose sampling (P3) first waits ``sample_sleep_s`` on the ranks of one
data-parallel engine core (``engine_core``; None: every core): under ``-dp N
--enable-expert-parallel`` that core's task then spends most of its time waiting for its
step's output while the other cores, answered already, have sent their next forward (tests
of the engine stopped at that moment: engine/dp_lockstep.py)."""

from __future__ import annotations

import time
from typing import Any

from trillm.interfaces import Bitmask
from trillm.messages import ModelRunnerOutput
from trillm.worker.model_runner import ModelRunner


class SlowSamplingRunner(ModelRunner):
    def __init__(
        self,
        config: Any,
        rank: int = 0,
        *,
        sample_sleep_s: float = 0.0,
        engine_core: int | None = None,
        **kw: Any,
    ) -> None:
        super().__init__(config, rank, **kw)
        here = engine_core is None or engine_core == config.parallel.data_parallel_rank
        self.sample_sleep_s = sample_sleep_s if here else 0.0

    def sample_tokens(self, bitmask: Bitmask | None) -> ModelRunnerOutput:
        time.sleep(self.sample_sleep_s)  # the worker's own thread: stands for a slow sampler
        return super().sample_tokens(bitmask)
