"""A pooling model runner whose worker refuses one prompt (as ``_update_batch`` refuses a new
request whose data it cannot take: that request alone fails, the step runs without it): tests
of a step that keeps no request under ``-dp N --enable-expert-parallel``, whose ranks must
still take part in the MoE exchanges the other cores' ranks wait in.

Runner argument: ``refuse_prompt`` (token ids: a new request with exactly this prompt is
refused by the worker).
"""

from __future__ import annotations

from typing import Any

from trillm.messages import SchedulerOutput
from trillm.worker.pooling_runner import PoolingModelRunner


class RefusingPoolingRunner(PoolingModelRunner):
    def __init__(self, config: Any, rank: int = 0, *, refuse_prompt: list[int]) -> None:
        super().__init__(config, rank)
        self.refuse_prompt = list(refuse_prompt)

    def _update_batch(self, sched: SchedulerOutput) -> dict[str, str]:
        failed = super()._update_batch(sched)
        for new in sched.scheduled_new_reqs:
            if new.prompt_token_ids == self.refuse_prompt and new.req_id not in failed:
                failed[new.req_id] = "RuntimeError: told to refuse this prompt"
                self._drop(new.req_id)
        return failed
