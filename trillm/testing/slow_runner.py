"""``PoolingModelRunner`` whose every step first waits ``step_sleep_s``: a real pooling model
whose requests stay in flight long enough for a test to see them held (the queue bound on
/v1/embeddings). The delay is the ``step_sleep_s`` runner argument, else ``step_sleep_s`` in
``slow_runner.json`` in the model folder (how
``trillm serve --runner trillm.testing.slow_runner:SlowPoolingRunner --convert embed`` gets it).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from trillm.messages import SchedulerOutput
from trillm.worker.pooling_runner import PoolingModelRunner

SETTINGS_FILE = "slow_runner.json"


class SlowPoolingRunner(PoolingModelRunner):
    def __init__(self, config: Any, rank: int = 0, *, step_sleep_s: float | None = None) -> None:
        super().__init__(config, rank)
        if step_sleep_s is None:
            path = Path(config.model.model) / SETTINGS_FILE
            step_sleep_s = json.loads(path.read_text())["step_sleep_s"] if path.is_file() else 0
        self.step_sleep_s = float(step_sleep_s)

    def execute_model(self, sched: SchedulerOutput) -> None:
        time.sleep(self.step_sleep_s)  # the worker's own thread: stands for a slower model
        super().execute_model(sched)
