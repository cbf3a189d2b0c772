"""The executor's side of ``collective_rpc`` over the result rings: every rank's answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trillm.ipc import codec
from trillm.ipc.control import WorkerCallResult
from trillm.ipc.shm_ring import RingReader
from trillm.messages import ModelRunnerOutput
from trillm.worker.worker_rpc import WorkerCallError


class WorkerCallProtocolError(RuntimeError):
    """A rank answered a call with something else: the link is out of step (fatal)."""


async def collect_call_results(
    reader: Callable[[int], RingReader], read_order: list[int], world_size: int
) -> list[Any]:
    """Each rank's ``WorkerCallResult`` (read in ``read_order``) -> the values, by rank; a
    rank's error raises ``WorkerCallError`` once every rank has answered (the rings stay in
    step).

    Step outputs before a rank's answer are skipped: a call is sent between steps only, so
    they belong to a ``sample_tokens`` call that its caller cancelled (with the experts over
    every engine core, a core stopped while it waits for its step's output still sends the
    dummy forwards the other cores' last steps need: engine/dp_lockstep.py).
    """
    results: dict[int, WorkerCallResult] = {}
    for rank in read_order:
        msg = codec.decode(await reader(rank).recv())
        while isinstance(msg, ModelRunnerOutput):
            msg = codec.decode(await reader(rank).recv())
        if not isinstance(msg, WorkerCallResult):
            raise WorkerCallProtocolError(
                f"Worker rank {rank} sent {type(msg).__name__}, expected a call result."
            )
        results[rank] = msg
    return call_values([results[rank] for rank in range(world_size)])


def call_values(results: list[WorkerCallResult]) -> list[Any]:
    """Every rank's result, by rank -> their values; a rank's error raises
    ``WorkerCallError``."""
    for result in results:
        if result.error is not None:
            raise WorkerCallError(f"Worker rank {result.rank}: {result.error}")
    return [result.value for result in results]
