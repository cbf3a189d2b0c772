"""The executor contract (P2/P3 of ``EngineCore.step``); ``factory.open_executor`` builds one.

An executor is a Trio service: ``await nursery.start(executor.run)`` returns once the workers
have loaded the model and allocated the KV cache (``executor.num_blocks`` is then set, and
``config.cache.num_blocks`` with it); ``await executor.shutdown()`` stops it and makes ``run``
return. ``trillm.executor.factory.open_executor`` wraps both.

Errors, as seen by the engine core:
- ``ModelExecutionError`` from ``sample_tokens``: this step failed in a worker (its traceback is
  in the message); the worker is alive, the engine fails the step's requests and carries on.
- ``EngineDeadError`` from any call (and from ``check_health``): a worker is gone; every
  in-flight and later call raises it.
"""

from __future__ import annotations

import abc
from typing import TYPE_CHECKING, Any, TypeAlias

import trio

from trillm.errors import EngineDeadError
from trillm.messages import ModelRunnerOutput, SampleRequest, SchedulerOutput

if TYPE_CHECKING:
    from trillm.interfaces import RunnerClass

DEFAULT_RUNNER = "trillm.worker.model_runner:ModelRunner"
FAKE_RUNNER = "trillm.worker.fake_runner:FakeModelRunner"
POOLING_RUNNER = "trillm.worker.pooling_runner:PoolingModelRunner"
ENCODER_RUNNER = "trillm.worker.encoder_runner:EncoderModelRunner"

# "package.module:ClassName", or (UniProcExecutor only) a callable (config, rank, **kw) -> runner
RunnerFactory: TypeAlias = "str | RunnerClass"


class Executor(abc.ABC):
    num_blocks: int
    # Pipeline parallelism (the multi-rank executors set both): with stages, the engine core
    # keeps a batch queue of up to max_concurrent_batches steps that ``execute_model`` may
    # have in flight before ``collect_step``.
    num_pipeline_stages: int = 1
    max_concurrent_batches: int = 1

    @abc.abstractmethod
    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Start the workers; ``task_status.started()`` once the KV cache is allocated; then
        serve until ``shutdown``."""

    @abc.abstractmethod
    async def execute_model(self, sched: SchedulerOutput) -> None:
        """P2: hand the step to the workers; returns once sent, not once computed."""

    @abc.abstractmethod
    async def sample_tokens(self, req: SampleRequest | None) -> ModelRunnerOutput:
        """P3: rank 0's result for the step last passed to ``execute_model``.

        ``req`` carries the grammar bitmask when that step had ``wait_for_bitmask`` set (None
        then means "no mask"); it must be None otherwise.
        """

    async def start_sampling(self, req: SampleRequest | None) -> None:
        """The first half of ``sample_tokens``: P3's trigger for the step last passed to
        ``execute_model`` (its bitmask), without waiting for any output."""
        raise NotImplementedError(f"{type(self).__name__} has no batch queue.")

    async def collect_step(self) -> ModelRunnerOutput:
        """The second half: the output of the oldest step whose sampling was started."""
        raise NotImplementedError(f"{type(self).__name__} has no batch queue.")

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        """``method`` on every rank's runner (``trillm/worker/worker_rpc.py``), between steps
        (the engine core calls it with no step in flight): -> each rank's result, by rank.
        A rank's failure raises ``WorkerCallError`` naming it; the workers carry on."""
        raise NotImplementedError(f"{type(self).__name__} runs no collective_rpc.")

    @abc.abstractmethod
    def check_health(self) -> None:
        """Raise ``EngineDeadError`` if a worker is gone (or the executor was shut down)."""

    async def wait_failed(self) -> EngineDeadError:
        """Returns (the death error) once a worker is gone, even while no step runs; never
        for a shutdown. Default: an in-process executor has no workers to lose."""
        await trio.sleep_forever()
        raise AssertionError("unreachable")

    @abc.abstractmethod
    async def shutdown(self) -> None:
        """Stop the workers and release shared memory; idempotent."""
