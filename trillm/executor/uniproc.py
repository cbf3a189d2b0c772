"""UniProcExecutor: the runner in this process, its calls in a worker thread.

``execute_model`` starts the forward pass in a thread and returns at once, so the engine can
compute grammar bitmasks meanwhile; ``sample_tokens`` waits for it, then samples (also in a
thread). The Trio loop stays responsive throughout.
"""

from __future__ import annotations

import traceback
from typing import Any

import trio

from trillm.config import TrillmConfig
from trillm.errors import EngineDeadError, ModelExecutionError
from trillm.executor.abstract import DEFAULT_RUNNER, Executor, RunnerFactory
from trillm.interfaces import ModelRunnerProtocol, RunnerClass
from trillm.messages import ModelRunnerOutput, SampleRequest, SchedulerOutput
from trillm.worker import worker_rpc
from trillm.worker.step_timing import ExecuteClock
from trillm.worker.worker_main import load_runner_class


class _Step:
    """One step between execute_model and sample_tokens."""

    def __init__(self, sched: SchedulerOutput) -> None:
        self.sched = sched
        self.done = trio.Event()
        self.error: str | None = None


class UniProcExecutor(Executor):
    def __init__(
        self,
        config: TrillmConfig,
        runner_factory: RunnerFactory = DEFAULT_RUNNER,
        runner_kwargs: dict[str, Any] | None = None,
    ) -> None:
        self.config = config
        self.num_blocks = 0
        self._factory: RunnerClass = (
            load_runner_class(runner_factory) if isinstance(runner_factory, str) else runner_factory
        )
        self._kwargs = runner_kwargs or {}
        self._runner: ModelRunnerProtocol | None = None  # set once run() has loaded it
        self._step: _Step | None = None
        self._nursery: trio.Nursery | None = None
        self._stop = trio.Event()
        self._dead: EngineDeadError | None = None
        self._clock = ExecuteClock(config.collect_model_execute_time)  # detailed traces

    def _start_runner(self) -> int:
        runner = self._factory(self.config, 0, **self._kwargs)
        runner.load_model()
        num_blocks = runner.determine_num_blocks()
        runner.initialize_kv_cache(num_blocks)
        self._runner = runner
        return num_blocks

    @property
    def runner(self) -> ModelRunnerProtocol:
        """The loaded runner; RuntimeError before ``run()`` has loaded it."""
        if self._runner is None:
            raise RuntimeError(
                "The executor's model runner is not loaded yet (await nursery.start(run))."
            )
        return self._runner

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        self.num_blocks = await trio.to_thread.run_sync(self._start_runner)
        self.config.cache.num_blocks = self.num_blocks
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    async def _run_execute(self, step: _Step) -> None:
        def call() -> None:
            try:
                self._clock.run(self.runner.execute_model, step.sched)
            except Exception:
                step.error = traceback.format_exc()

        try:
            await trio.to_thread.run_sync(call)
        finally:
            step.done.set()

    async def execute_model(self, sched: SchedulerOutput) -> None:
        self.check_health()
        if self._step is not None:
            raise RuntimeError("execute_model called twice without sample_tokens in between.")
        self._step = _Step(sched)
        assert self._nursery is not None  # check_health passed, so run() has started
        self._nursery.start_soon(self._run_execute, self._step)

    async def sample_tokens(self, req: SampleRequest | None) -> ModelRunnerOutput:
        self.check_health()
        step = self._step
        if step is None:
            raise RuntimeError("sample_tokens called without execute_model.")
        if req is not None and not step.sched.wait_for_bitmask:
            raise ValueError("A SampleRequest was given for a step without wait_for_bitmask.")
        self._step = None
        await step.done.wait()
        self.check_health()
        if step.error is None:
            bitmask = req.bitmask if req is not None else None
            try:
                run = self._clock.run
                out = await trio.to_thread.run_sync(run, self.runner.sample_tokens, bitmask)
                self._clock.stamp(out)
                return out
            except Exception:
                step.error = traceback.format_exc()
        self._clock.seconds = 0.0  # the failed step's
        raise ModelExecutionError(
            f"Step {step.sched.step_id} failed in the model runner:\n{step.error}",
            rank=0,
            step_id=step.sched.step_id,
        )

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        self.check_health()
        value = await trio.to_thread.run_sync(
            lambda: worker_rpc.call(self.runner, method, args, kwargs)
        )
        return [value]

    def check_health(self) -> None:
        if self._dead is not None:
            raise self._dead
        if self._nursery is None:
            raise EngineDeadError("The executor has not been started (await nursery.start(run)).")

    async def shutdown(self) -> None:
        if self._dead is None:
            self._dead = EngineDeadError("The executor was shut down.")
        self._stop.set()
        await trio.lowlevel.checkpoint()
