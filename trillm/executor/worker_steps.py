"""The executor's side of a model step over the result rings: how many steps are in flight,
every rank's output for one, and what in those outputs is fatal."""

from __future__ import annotations

import trio

from trillm import envs
from trillm.errors import ModelExecutionError
from trillm.executor.worker_exits import WorkerExits
from trillm.ipc import codec
from trillm.ipc.control import WorkerFailed
from trillm.ipc.shm_ring import RingReader
from trillm.messages import ModelRunnerOutput


class WorkerStepProtocolError(RuntimeError):
    """A rank failed outside its model code, or answered out of step: fatal for the executor."""


def micro_batches(num_stages: int) -> int:
    """Steps in flight at once: ``TRILLM_PP_MICRO_BATCHES`` (1 .. num_stages) when set, else one
    per pipeline stage (1 without pipeline parallelism)."""
    count = envs.PP_MICRO_BATCHES.get()
    if count is None:
        return num_stages
    if count > num_stages:
        raise ValueError(
            f"TRILLM_PP_MICRO_BATCHES='{count}': must be an integer from 1 to "
            f"pipeline_parallel_size={num_stages}."
        )
    return count


async def collect_step_outputs(
    rings: list[tuple[int, RingReader]], world_size: int, step_id: int, exits: WorkerExits
) -> list[ModelRunnerOutput]:
    """Every rank's output for ``step_id``, by rank; ``rings``: (rank, the ring its reply
    arrives on), in the order the replies arrive.

    Outputs of earlier steps are skipped: they belong to a ``sample_tokens`` call that its
    caller cancelled (the step's requests are then the engine's to clean up).
    """
    outputs: dict[int, ModelRunnerOutput] = {}
    for rank, ring in rings:
        msg = codec.decode(await ring.recv())
        while isinstance(msg, ModelRunnerOutput) and msg.step_id < step_id:
            msg = codec.decode(await ring.recv())
        if isinstance(msg, WorkerFailed):
            # NOTE: msg.rank, not ``rank``: rank 0's ring carries its own last words where
            # another node's reply was due.
            if msg.collective:  # its supervisor names the silent ranks, then fails us
                exits.report(msg)
                await trio.sleep_forever()
            raise WorkerStepProtocolError(f"Worker rank {msg.rank} failed:\n{msg.message}")
        if not isinstance(msg, ModelRunnerOutput) or msg.step_id != step_id:
            got = f"step {msg.step_id}" if isinstance(msg, ModelRunnerOutput) else repr(msg)
            raise WorkerStepProtocolError(f"Worker rank {rank} sent {got}, expected {step_id}.")
        outputs[rank] = msg
    return [outputs[rank] for rank in range(world_size)]


def raise_model_errors(outputs: list[ModelRunnerOutput]) -> None:
    """ModelExecutionError for the first rank whose model code failed the step (the executor
    lives on: the engine fails the step's requests)."""
    for rank, out in enumerate(outputs):
        if out.error is not None:
            raise ModelExecutionError(
                f"Step {out.step_id} failed in worker rank {rank}:\n{out.error}",
                rank=rank,
                step_id=out.step_id,
                output=out,
            )


def divergence(outputs: list[ModelRunnerOutput], output_rank: int) -> str | None:
    """Why the last stage's ranks disagree, if they do: a rank whose tokens differ from the
    output rank's would compute the next steps on other inputs (its KV cache no longer
    matches), which is fatal. (The earlier stages sample nothing: they get the tokens with the
    next step.)"""
    first = outputs[output_rank]
    for rank, out in enumerate(outputs[output_rank:], start=output_rank):
        if out.sampled_token_ids != first.sampled_token_ids or out.req_ids != first.req_ids:
            return (
                f"Rank {rank} sampled other tokens than rank {output_rank} in step "
                f"{first.step_id}: the ranks diverged."
            )
    return None


def step_output(outputs: list[ModelRunnerOutput], output_rank: int) -> ModelRunnerOutput:
    """The step's output (``output_rank``'s) once every rank's is checked: ModelExecutionError
    for a failed model step, WorkerStepProtocolError (fatal) for diverged ranks."""
    raise_model_errors(outputs)
    diverged = divergence(outputs, output_rank)
    if diverged is not None:
        raise WorkerStepProtocolError(diverged)
    out = outputs[output_rank]
    spent = [o.kv_offload_seconds for o in outputs if o.kv_offload_seconds]
    if spent:  # the KV offload tier: every rank copied its share
        out.kv_offload_seconds = [sum(s[i] for s in spent) for i in range(2)]
    if output_rank:  # pipeline stages: each counted the pairs its own layers routed
        out.expert_load = stage_expert_loads(outputs, len(outputs) - output_rank)
    return out


def stage_expert_loads(outputs: list[ModelRunnerOutput], tp: int) -> list[int]:
    """Expert parallelism with pipeline stages: the pairs routed to each global rank's experts
    (stage s's rank r is global rank s * tp + r and holds the r-th block of the experts of
    stage s's layers; each rank of a stage counts its stage's routing for every rank of it),
    zeros for a stage without a mixture-of-experts layer; [] without expert parallelism."""
    loads = [outputs[first].expert_load for first in range(0, len(outputs), tp)]
    if not any(loads):
        return []
    return [pairs for load in loads for pairs in (load or [0] * tp)]
