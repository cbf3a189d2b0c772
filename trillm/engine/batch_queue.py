"""The engine core's batch queue (pipeline parallelism, issue 14; vLLM's batch queue).

With M pipeline stages the engine core keeps up to M steps in flight, so that stage 0 computes
step i + 1 while stage 1 computes step i. ``BatchQueue`` owns what that needs: the steps sent
and not yet answered (oldest first; their outputs are applied in step order), each with the
requests it was sent for, and the tokens the last stage sampled that the other stages have not
been sent yet (they ride on the next step: ``SchedulerOutput.pp_sampled_token_ids``). The
engine core drives it (``EngineCore._step_with_batch_queue``); the scheduler keeps the steps
disjoint (``schedule(busy=queue.busy(), max_reqs=queue.share(live))``).
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

from trillm.messages import ModelRunnerOutput, SchedulerOutput
from trillm.utils import cdiv

GetRequest = Callable[[str], object]  # the scheduler's get_request


@dataclass(slots=True)
class _InFlightStep:
    """A step sent, its output not applied yet."""

    sched: SchedulerOutput
    owners: dict[str, object]  # req_id -> the scheduler's request it was sent for

    def current(self, get: GetRequest) -> SchedulerOutput:
        """The step without the rows of requests aborted since whose id a new request took
        (its output there is not the new request's: it is dropped with them)."""
        sched = self.sched
        for req_id, owner in self.owners.items():
            now = get(req_id)
            if now is not None and now is not owner:
                sched.total_num_scheduled_tokens -= sched.num_scheduled_tokens.pop(req_id)
                sched.scheduled_spec_decode_tokens.pop(req_id, None)
        return sched


class BatchQueue:
    def __init__(self, max_batches: int) -> None:
        self.max_batches = max_batches
        self._steps: deque[_InFlightStep] = deque()
        self._tokens: dict[str, list[int]] = {}  # req_id -> tokens the other stages lack
        # How many steps were in flight right after each send (depth -> sends).
        self.depths: Counter[int] = Counter()

    def __len__(self) -> int:
        return len(self._steps)

    @property
    def full(self) -> bool:
        return len(self._steps) >= self.max_batches

    def busy(self) -> set[str]:
        """The requests of the steps in flight: not to be scheduled or preempted now."""
        return {r for step in self._steps for r in step.owners}

    def share(self, num_live: int) -> int:
        """One step's share of the live requests, so that the next step has some to run."""
        return cdiv(num_live, self.max_batches)

    def take_tokens(self) -> dict[str, list[int]]:
        """The tokens for the step about to be sent (given back if it is not sent)."""
        tokens, self._tokens = self._tokens, {}
        return tokens

    def give_back_tokens(self, tokens: dict[str, list[int]]) -> None:
        for req_id, new in self._tokens.items():
            tokens.setdefault(req_id, []).extend(new)
        self._tokens = tokens

    def push(self, sched: SchedulerOutput, get: GetRequest) -> None:
        self._steps.append(_InFlightStep(sched, {r: get(r) for r in sched.num_scheduled_tokens}))
        self.depths[len(self._steps)] += 1

    def pop_oldest(self, get: GetRequest) -> SchedulerOutput:
        """The oldest step, once it answered (it counts as in flight until then)."""
        return self._steps.popleft().current(get)

    def keep_tokens(self, sched: SchedulerOutput, out: ModelRunnerOutput, get: GetRequest) -> None:
        """The tokens the last stage appended in ``sched``, for the other stages, of requests
        still live."""
        for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
            if tokens and req_id in sched.num_scheduled_tokens and get(req_id) is not None:
                self._tokens.setdefault(req_id, []).extend(tokens)
