"""Builds the executor the config names ("uni": in-process, "mp": worker subprocesses, "ray":
Ray actors).

Kept apart from the ``Executor`` interface (``abstract.py``) so that the interface imports
none of its implementations."""

from __future__ import annotations

import contextlib
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import trio

from trillm.config import TrillmConfig
from trillm.executor.abstract import DEFAULT_RUNNER, Executor, RunnerFactory
from trillm.executor.multiproc import MultiprocExecutor
from trillm.utils import unwrap_group


def make_executor(
    config: TrillmConfig,
    runner_factory: RunnerFactory = DEFAULT_RUNNER,
    runner_kwargs: dict[str, Any] | None = None,
    **executor_kwargs: Any,
) -> Executor:
    """The executor ``config.parallel.distributed_executor_backend`` names."""
    backend = config.parallel.distributed_executor_backend
    if backend == "uni":
        # NOTE: imported here, not at the top: the in-process worker brings torch, which an
        # API server whose workers are subprocesses never needs (seconds of its startup).
        from trillm.executor.uniproc import UniProcExecutor

        return UniProcExecutor(config, runner_factory, runner_kwargs, **executor_kwargs)
    if backend == "mp":
        return MultiprocExecutor(config, runner_factory, runner_kwargs, **executor_kwargs)
    if backend == "ray":
        from trillm.executor.ray_executor import RayExecutor  # imports no Ray until run()

        return RayExecutor(config, runner_factory, runner_kwargs, **executor_kwargs)
    raise ValueError(f"Unknown distributed_executor_backend {backend!r}; use 'mp', 'uni' or 'ray'.")


@asynccontextmanager
async def open_executor(
    config: TrillmConfig,
    runner_factory: RunnerFactory = DEFAULT_RUNNER,
    runner_kwargs: dict[str, Any] | None = None,
    **executor_kwargs: Any,
) -> AsyncIterator[Executor]:
    """``async with open_executor(config) as ex:`` -- started on entry, shut down on exit."""
    executor = make_executor(config, runner_factory, runner_kwargs, **executor_kwargs)
    try:
        async with trio.open_nursery() as nursery:
            await nursery.start(executor.run)
            try:
                yield executor
            finally:
                with trio.CancelScope(shield=True):
                    await executor.shutdown()
    except BaseExceptionGroup as group:
        # NOTE: run() only raises before started(), so a lone error is the caller's own (or
        # the startup failure): re-raise it as is rather than wrapped in a group.
        raise unwrap_group(group) from None


@asynccontextmanager
async def open_executors(
    configs: list[TrillmConfig],
    runner_factory: RunnerFactory = DEFAULT_RUNNER,
    runner_kwargs: dict[str, Any] | None = None,
) -> AsyncIterator[list[Executor]]:
    """One executor per engine core (data parallelism), started together (their workers load
    at the same time) and shut down together on exit. One that fails to start stops the
    others (their workers are reaped) and its error is raised."""
    if len(configs) == 1:
        async with open_executor(configs[0], runner_factory, runner_kwargs) as executor:
            yield [executor]
        return
    executors = [make_executor(c, runner_factory, runner_kwargs) for c in configs]
    try:
        async with trio.open_nursery() as nursery:
            try:
                async with trio.open_nursery() as starting:
                    for executor in executors:
                        starting.start_soon(nursery.start, executor.run)
                yield executors
            finally:
                with trio.CancelScope(shield=True):
                    for executor in executors:
                        await executor.shutdown()
                _remove_expert_store(configs[0])
    except BaseExceptionGroup as group:
        raise unwrap_group(group) from None


def _remove_expert_store(config: TrillmConfig) -> None:
    """-dp N -ep: the file every core's ranks met at, once they are all gone (their store
    removes it when every rank leaves cleanly, not when one was killed)."""
    if config.parallel.expert_store:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(config.parallel.expert_store)
