"""P1's result: the ``StepPlan`` one ``Scheduler.schedule()`` call builds request by request
(tokens per request, new and cached requests, draft tokens, the structured-output count) and
turns into the step's ``SchedulerOutput``. Native twin: ``StepPlan`` in ``ext/step_plan.pyx``.
"""

from __future__ import annotations

from trillm.core.request import Request
from trillm.messages import CachedRequestData, NewRequestData, SchedulerOutput


class StepPlan:
    """What one schedule() call hands out, built up request by request."""

    def __init__(self, budget: int, max_reqs: int = 0) -> None:
        self.budget = budget
        self.max_reqs = max_reqs  # > 0: the most requests of the step
        self.num_scheduled: dict[str, int] = {}  # req_id -> num_scheduled_tokens
        self.new_reqs: list[NewRequestData] = []
        self.cached: dict[str, tuple[list[int], int]] = {}  # req_id -> (new blocks, computed)
        self.spec: dict[str, list[int]] = {}  # req_id -> draft tokens scheduled
        self.structured = 0

    @property
    def has_room(self) -> bool:
        return self.budget > 0 and (self.max_reqs <= 0 or len(self.num_scheduled) < self.max_reqs)

    def _schedule(self, request: Request, n: int) -> None:
        self.num_scheduled[request.request_id] = n
        self.budget -= n
        if request.sampling_params.structured_outputs is not None:
            self.structured += 1
        request.num_computed_tokens += n

    def add_cached(self, request: Request, n: int, new_blocks: list[int]) -> None:
        num_spec = request.num_computed_tokens + n - request.num_tokens
        if num_spec > 0:
            self.spec[request.request_id] = request.spec_token_ids[:num_spec]
        self.cached[request.request_id] = (new_blocks, request.num_computed_tokens)
        self._schedule(request, n)

    def add_new(self, request: Request, n: int, block_ids: list[int]) -> None:
        self.new_reqs.append(
            NewRequestData(
                req_id=request.request_id,
                prompt_token_ids=list(request.prompt_token_ids),
                output_token_ids=list(request.output_token_ids),
                sampling_params=request.sampling_params,
                block_ids=block_ids,
                num_computed_tokens=request.num_computed_tokens,
            )
        )
        self._schedule(request, n)

    def unschedule(self, request: Request) -> None:
        """A request scheduled earlier in this step was preempted: give its tokens back."""
        n = self.num_scheduled.pop(request.request_id, None)
        if n is None:
            return
        self.budget += n
        self.cached.pop(request.request_id, None)
        self.spec.pop(request.request_id, None)
        if request.sampling_params.structured_outputs is not None:
            self.structured -= 1

    def to_output(self, step_id: int, finished: list[str]) -> SchedulerOutput:
        cached = CachedRequestData()
        for req_id, (blocks, computed) in self.cached.items():
            cached.req_ids.append(req_id)
            cached.new_block_ids.append(blocks)
            cached.num_computed_tokens.append(computed)
        return SchedulerOutput(
            step_id=step_id,
            scheduled_new_reqs=self.new_reqs,
            scheduled_cached_reqs=cached,
            num_scheduled_tokens=self.num_scheduled,
            total_num_scheduled_tokens=sum(self.num_scheduled.values()),
            scheduled_spec_decode_tokens=self.spec,
            finished_req_ids=finished,
            wait_for_bitmask=self.structured > 0,
        )
