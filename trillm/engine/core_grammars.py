"""The engine core's side of structured outputs (the seed's cross-cutting concern): requests
wait for their compiled grammar (stage 4 -> 5), a step's bitmask rows are filled while P2 runs,
and P4's accepted tokens advance the matchers. ``EngineCore`` (``core.py``) calls these; the
matchers themselves belong to the ``StructuredOutputManager`` (``trillm/structured_output/``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from trillm.messages import (
    EngineCoreOutput,
    EngineCoreRequest,
    FinishReason,
    SampleRequest,
    SchedulerOutput,
)

if TYPE_CHECKING:
    from trillm.core.scheduler import Scheduler
    from trillm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class CoreGrammars:
    def __init__(
        self,
        scheduler: Scheduler,
        manager: StructuredOutputManager,
        refuse: Callable[[EngineCoreOutput], None],  # publishes a request the engine ended
    ) -> None:
        self.scheduler = scheduler
        self.manager = manager
        self._refuse = refuse

    def add(self, msg: EngineCoreRequest) -> None:
        """Stage 4 -> 5: a matcher now when the grammar is compiled (the frontend compiled
        it), else the request waits in WAITING_FOR_GRAMMAR without holding others back."""
        so = self.manager
        try:
            # The prompt tells a reasoning model's request whether it starts past reasoning.
            ready = so.add_request(
                msg.request_id, msg.sampling_params.structured_outputs, msg.prompt_token_ids
            )
        except Exception as exc:  # one request's grammar: never the engine
            so.remove(msg.request_id)
            self._end_request(msg.request_id, f"{type(exc).__name__}: {exc}")
            return
        if not ready:
            self.scheduler.set_waiting_for_grammar(msg.request_id)

    def num_waiting(self) -> int:
        """Requests held in the scheduler until their grammar compiles."""
        return int(self.manager.num_pending)

    def poll(self) -> None:
        """Grammars compiled since the last step release their requests."""
        if not self.manager.has_pending:
            return
        ready, failed = self.manager.poll()
        for req_id in ready:
            self.scheduler.grammar_ready(req_id)
        for req_id, why in failed:
            self._end_request(req_id, why)

    def _end_request(self, req_id: str, why: str) -> None:
        # NOTE: the frontend compiles first and answers 400, so this is a cache eviction race
        # or a caller that bypassed it: the request ends, the engine goes on.
        logger.error("request %s: its grammar cannot be used: %s", req_id, why)
        self.scheduler.finish_requests([req_id], FinishReason.ABORT)
        self._refuse(EngineCoreOutput(req_id, [], finish_reason=FinishReason.ABORT))

    def bitmask(self, sched: SchedulerOutput) -> SampleRequest | None:
        """P2 overlap: the bitmask rows of this step's constrained requests that sample.
        None (no SampleRequest at all) for a step without one."""
        if not sched.wait_for_bitmask:
            return None
        so = self.manager
        get = self.scheduler.get_request

        def samples(req_id: str) -> bool:  # the step reaches the end of its tokens
            r = get(req_id)
            return r is not None and r.num_computed_tokens >= r.num_tokens

        mask: SampleRequest | None = so.fill_bitmask(sched, samples)
        return mask

    def advance(self, outputs: list[EngineCoreOutput]) -> None:
        """P4: accepted tokens advance the matchers; a terminated grammar finishes its
        request with ``stop``, a token outside it (cannot happen under the bitmask) aborts."""
        so = self.manager
        if not so.matchers:
            return
        for out in outputs:
            if not out.new_token_ids or out.request_id not in so.matchers:
                continue
            ok, terminated = so.accept_tokens(out.request_id, out.new_token_ids)
            if out.finish_reason is None and (terminated or not ok):
                reason = FinishReason.STOP if ok else FinishReason.ABORT
                self.scheduler.finish_requests([out.request_id], reason)
                out.finish_reason = reason
        get = self.scheduler.get_request
        so.retain(lambda req_id: get(req_id) is not None)
