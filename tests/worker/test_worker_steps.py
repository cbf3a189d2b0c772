"""The executor's reading of one step's outputs (``trillm/executor/worker_steps.py``), over
stand-in rings: stale outputs skipped, out-of-step and failed ranks fatal, diverged last-stage
ranks named. (The processes behind real rings: tests/worker/test_executor.py.)"""

from __future__ import annotations

from typing import Any

import pytest
import trio

from trillm.errors import ModelExecutionError
from trillm.executor.worker_steps import (
    WorkerStepProtocolError,
    collect_step_outputs,
    divergence,
    raise_model_errors,
    step_output,
)
from trillm.ipc import codec
from trillm.ipc.control import WorkerFailed
from trillm.messages import ModelRunnerOutput


class _Ring:
    """A result ring that hands out the given messages in order."""

    def __init__(self, *messages: Any) -> None:
        self.frames = [codec.encode(m) for m in messages]

    async def recv(self) -> bytes:
        return self.frames.pop(0)


def _out(step_id: int, tokens: list[list[int]], error: str | None = None) -> ModelRunnerOutput:
    return ModelRunnerOutput(step_id, ["a"] * len(tokens), tokens, error=error)


def _collect(rings: dict[int, _Ring], step_id: int) -> list[ModelRunnerOutput]:
    async def main() -> list[ModelRunnerOutput]:
        # no WorkerExits: no rank here reports a timed-out collective
        return await collect_step_outputs(sorted(rings.items()), len(rings), step_id, None)

    return trio.run(main)


def test_outputs_come_back_by_rank_with_a_cancelled_steps_outputs_skipped() -> None:
    rings = {0: _Ring(_out(6, [[1]]), _out(7, [[2]])), 1: _Ring(_out(7, [[2]]))}
    outputs = _collect(rings, 7)
    assert [o.step_id for o in outputs] == [7, 7]
    assert outputs[0].sampled_token_ids == [[2]]


def test_a_rank_out_of_step_or_failed_is_fatal_naming_it() -> None:
    with pytest.raises(WorkerStepProtocolError, match=r"^Worker rank 1 sent step 9, expected 7\."):
        _collect({0: _Ring(_out(7, [[2]])), 1: _Ring(_out(9, [[2]]))}, 7)
    failed = WorkerFailed(1, "Traceback: boom")
    with pytest.raises(WorkerStepProtocolError, match=r"^Worker rank 1 failed:\nTraceback: boom"):
        _collect({0: _Ring(failed)}, 7)


def test_a_model_error_names_its_rank_and_step() -> None:
    outputs = [_out(3, [[1]]), _out(3, [], error="ValueError: bad")]
    with pytest.raises(ModelExecutionError, match=r"^Step 3 failed in worker rank 1:\nValueError"):
        raise_model_errors(outputs)
    raise_model_errors([_out(3, [[1]])])


def test_last_stage_ranks_that_sampled_other_tokens_are_named() -> None:
    # ranks 0-1: stage 0 (samples nothing); ranks 2-3: the last stage, output rank 2
    outputs = [_out(4, []), _out(4, []), _out(4, [[5]]), _out(4, [[5]])]
    assert divergence(outputs, 2) is None
    outputs[3] = _out(4, [[6]])
    assert divergence(outputs, 2) == (
        "Rank 3 sampled other tokens than rank 2 in step 4: the ranks diverged."
    )


def test_the_step_output_is_the_output_ranks_once_all_are_checked() -> None:
    outputs = [_out(4, []), _out(4, [[5]]), _out(4, [[5]])]
    assert step_output(outputs, 1) is outputs[1]
    with pytest.raises(ModelExecutionError, match=r"^Step 4 failed in worker rank 0"):
        step_output([_out(4, [], error="boom"), *outputs[1:]], 1)
    outputs[2] = _out(4, [[6]])
    with pytest.raises(WorkerStepProtocolError, match=r"^Rank 2 sampled other tokens"):
        step_output(outputs, 1)
