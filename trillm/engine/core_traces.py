"""``--collect-detailed-traces`` on the engine core: each request's model forward and execute
seconds, summed over the steps that ran it (a step's times, ``ModelRunnerOutput``'s, count
once for every request it scheduled, as vLLM's V0 engine added them to each scheduled
sequence group). Every output of a request carries its totals so far
(``EngineCoreOutput.model_times``), so a request that a stop string ends in the output
handler has them too; the output handler puts the last ones on its finished sample
(``CompletionOutput``), whose span carries them."""

from __future__ import annotations

from trillm.messages import EngineCoreOutput, ModelRunnerOutput, SchedulerOutput


class CoreTraces:
    """req_id -> [forward s, execute s] while the request lives in the engine core."""

    __slots__ = ("forward", "execute", "_totals")

    def __init__(self, forward: bool, execute: bool) -> None:
        self.forward = forward
        self.execute = execute
        self._totals: dict[str, list[float]] = {}

    def step(
        self, sched: SchedulerOutput, out: ModelRunnerOutput, outputs: list[EngineCoreOutput]
    ) -> None:
        """The step's times to each request it scheduled; ``outputs`` (the step's, P4) carry
        the totals; a finished request's are dropped."""
        forward = out.model_forward_time or 0.0
        execute = out.model_execute_time or 0.0
        totals = self._totals
        for req_id in sched.num_scheduled_tokens:
            t = totals.get(req_id)
            if t is None:
                totals[req_id] = [forward, execute]
            else:
                t[0] += forward
                t[1] += execute
        for o in outputs:
            t = totals.pop(o.request_id, None) if o.finished else totals.get(o.request_id)
            if t is not None:
                o.model_times = (t[0] if self.forward else None, t[1] if self.execute else None)

    def forget(self, req_ids: list[str]) -> None:
        """Requests that ended without a finished output of P4 (aborted, failed)."""
        for req_id in req_ids:
            self._totals.pop(req_id, None)
