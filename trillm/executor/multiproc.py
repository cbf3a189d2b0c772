"""MultiprocExecutor: one worker subprocess per rank (tensor x pipeline), behind shared-memory rings.

    engine --SchedulerOutput / SampleRequest--> request ring (1 writer, N readers: every rank)
    rank r --ModelRunnerOutput--> result ring r (1 writer, 1 reader: the engine)

Every rank receives every message and answers every step; ``sample_tokens`` returns the
output of the last pipeline stage's first rank (rank 0 without pipeline parallelism; it holds
the logprobs) and checks the others for errors, and that the last stage's other ranks returned
its tokens (the earlier stages sample nothing). With pipeline stages up to
``max_concurrent_batches`` steps are in flight at once (the engine core's batch queue:
``execute_model`` + ``start_sampling`` per step, ``collect_step`` for the oldest), so that
stage 0 computes step i + 1 while the next stage computes step i. ``TRILLM_PP_MICRO_BATCHES``
(1 .. pipeline_parallel_size; default pipeline_parallel_size) sets that number, for
comparisons. With
``tensor_parallel_size > 1`` each rank runs its shard of the model and the ranks meet in
``torch.distributed`` collectives (``trillm/distributed/``), at a loopback port picked here.
A rank whose collective times out (a peer stopped answering) reports it and exits; the
executor then names the ranks that did not report (the ones that stopped). The rings, fds and
command lines of the workers: ``worker_ipc.py``; the messages that name their exits:
``worker_exits.py``; every rank's output for a step, and what in it is fatal:
``worker_steps.py``.

Supervision: a task per worker awaits its process exit. An exit that is not part of
``shutdown`` marks the executor dead: the other workers are killed, the segments are unlinked,
every in-flight call is cancelled and raises ``EngineDeadError`` (naming the rank and the exit
code or signal), and so does every later call. A step that gets no answer within
``step_timeout_s`` is treated the same way (a hung worker). Workers exit by themselves when
this process dies (see ``trillm/worker/worker_main.py``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from trillm.config import TrillmConfig
from trillm.errors import EngineDeadError, EngineStartupError, IPCError
from trillm.executor.abstract import DEFAULT_RUNNER, Executor, RunnerFactory
from trillm.executor.bookkeeping import Lifeline, StepQueue, runner_name
from trillm.executor.rank_launch import RankProcess, start_ranks
from trillm.executor.worker_calls import WorkerCallProtocolError, collect_call_results
from trillm.executor.worker_exits import WorkerExits
from trillm.executor.worker_ipc import WorkerIpc, rendezvous_listener
from trillm.executor.worker_steps import (
    WorkerStepProtocolError,
    collect_step_outputs,
    micro_batches,
    step_output,
)
from trillm.ipc import codec
from trillm.ipc.control import (
    InitKVCache,
    InitWorker,
    Shutdown,
    WorkerFailed,
    WorkerReady,
)
from trillm.ipc.shm_ring import RingReader
from trillm.ipc.shm_segment import DEFAULT_NUM_SLOTS, DEFAULT_SLOT_SIZE
from trillm.messages import ModelRunnerOutput, SampleRequest, SchedulerOutput
from trillm.utils import unwrap_group
from trillm.worker.step_timing import stage_times

T = TypeVar("T")

STARTUP_TIMEOUT_S = 900.0  # model load + cache allocation
STEP_TIMEOUT_S = 300.0
SHUTDOWN_GRACE_S = 5.0


class MultiprocExecutor(Executor):
    def __init__(
        self,
        config: TrillmConfig,
        runner_factory: RunnerFactory = DEFAULT_RUNNER,
        runner_kwargs: dict[str, Any] | None = None,
        *,
        num_slots: int = DEFAULT_NUM_SLOTS,
        slot_size: int = DEFAULT_SLOT_SIZE,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        step_timeout_s: float | None = STEP_TIMEOUT_S,
    ) -> None:
        self.runner_spec = runner_name(runner_factory, "MultiprocExecutor", "the worker process")
        self.config = config
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(
                f"node_rank={parallel.node_rank}: the engine runs on node 0; another node runs "
                "only its worker ranks (trillm serve --headless --node-rank N)."
            )
        self.num_workers = parallel.ranks_per_node  # the worker processes on this node
        self.world_size = parallel.world_size
        # Where each rank's replies arrive, in the order they do: rank 0's ring carries its
        # own, then (relayed by rank 0) those of the ranks on other nodes.
        self.remote_ranks = parallel.remote_ranks()
        self._read_order = [0, *self.remote_ranks, *range(1, self.num_workers)]
        # The rank whose output is the step's: tensor-parallel rank 0 of the last stage.
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        self.runner_kwargs = runner_kwargs or {}
        self.num_slots, self.slot_size = num_slots, slot_size
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.num_blocks = 0
        self.processes: list[RankProcess] = []
        self.segment_names: list[str] = []
        self._ipc: WorkerIpc | None = None
        self.num_pipeline_stages = parallel.pipeline_parallel_size
        self.max_concurrent_batches = micro_batches(self.num_pipeline_stages)
        self._steps: StepQueue[None] = StepQueue(self.max_concurrent_batches)
        self._life = Lifeline()  # failed: a worker is gone (not a shutdown)
        self._exits = WorkerExits(parallel, self.num_workers)  # what ended a worker, said
        self._stopping = False
        self._started = False
        self._stop = trio.Event()
        self._stopped = trio.Event()

    @property
    def ipc(self) -> WorkerIpc:
        if self._ipc is None:
            raise EngineDeadError("The executor has not been started (await nursery.start(run)).")
        return self._ipc

    @property
    def worker_pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    # ------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        listener = None
        if self.world_size > 1 and not self.config.parallel.master_port:
            listener = rendezvous_listener()
            self.config.parallel.master_port = listener.getsockname()[1]
        try:
            ipc = WorkerIpc(self.num_workers, self.num_slots, self.slot_size, listener)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        self._ipc = ipc
        self.segment_names = ipc.segment_names()
        try:
            async with trio.open_nursery() as nursery:
                engine = self.config.parallel.data_parallel_rank
                specs = [ipc.worker_args(rank, engine) for rank in range(self.num_workers)]
                with trio.move_on_after(self.startup_timeout_s) as starting:
                    self.processes = await start_ranks(specs)
                if starting.cancelled_caught:
                    raise EngineStartupError(
                        f"The worker processes did not start within {self.startup_timeout_s} s."
                    )
                for rank, proc in enumerate(self.processes):
                    nursery.start_soon(self._supervise, rank, proc)
                ipc.close_death_read_end()  # the workers hold it now
                await self._guarded(self._handshake, self.startup_timeout_s, "start up")
                self._started = True
                task_status.started()
                await self._stop.wait()
                await self._stop_workers()
                nursery.cancel_scope.cancel()
        except BaseExceptionGroup as group:
            raise unwrap_group(group) from None
        finally:
            with trio.CancelScope(shield=True):
                await self._reap(kill=True)
            self._life.shut_down()
            ipc.close()
            self._stopped.set()

    async def _handshake(self) -> None:
        init = codec.encode(InitWorker(self.config, self.runner_spec, self.runner_kwargs))
        await self.ipc.requests.send(init)
        loaded = [await self._recv_control(rank, "loaded") for rank in self._read_order]
        self.num_blocks = min(r.num_blocks for r in loaded)
        self.config.cache.num_blocks = self.num_blocks
        await self.ipc.requests.send(codec.encode(InitKVCache(self.num_blocks)))
        for rank in self._read_order:
            await self._recv_control(rank, "kv_cache")

    def _reader(self, rank: int) -> RingReader:
        """The ring ``rank``'s replies arrive on (rank 0's for the other nodes' ranks)."""
        return self.ipc.results[rank if rank < self.num_workers else 0]

    async def _recv_control(self, rank: int, phase: str) -> WorkerReady:
        msg = codec.decode(await self._reader(rank).recv())
        if isinstance(msg, WorkerFailed):
            raise self._fail(
                EngineStartupError(f"Worker rank {msg.rank} failed to start:\n{msg.message}")
            )
        if not isinstance(msg, WorkerReady) or msg.phase != phase:
            raise self._fail(EngineStartupError(f"Worker rank {rank} sent {msg!r} during startup."))
        return msg

    async def _supervise(self, rank: int, proc: RankProcess) -> None:
        code = await proc.wait()
        if self._stopping:
            return
        message = await self._exits.message(self.ipc, rank, proc.pid, code)
        if message is None:
            return  # another rank's timed-out collective is being reported
        error_type = EngineDeadError if self._started else EngineStartupError
        self._fail(error_type(message))

    async def _stop_workers(self) -> None:
        self._stopping = True
        if self._life.shut_down():
            try:
                with trio.move_on_after(SHUTDOWN_GRACE_S):
                    await self.ipc.requests.send(codec.encode(Shutdown()))
            except IPCError:
                pass
        with trio.move_on_after(SHUTDOWN_GRACE_S):
            await self._reap(kill=False)

    async def _reap(self, kill: bool) -> None:
        for proc in self.processes:
            if kill and proc.returncode is None:
                proc.kill()
            await proc.wait()

    # ------------------------------------------------------------ failure

    def _fail(self, error: EngineDeadError) -> EngineDeadError:
        """A worker is gone: kill the rest, unlink the segments, cancel every in-flight call.

        Returns the executor's death error (the first one recorded) for the caller to raise.
        """
        if self._life.fail(error):
            self._stopping = True  # the remaining exits are ours
            for proc in self.processes:
                if proc.returncode is None:
                    proc.kill()
            self.ipc.unlink()
        return self._life.death()

    async def wait_failed(self) -> EngineDeadError:
        return await self._life.wait_failed()

    async def _guarded(
        self,
        fn: Callable[..., Awaitable[T]],
        limit_s: float | None,
        what: str,
        *args: Any,
        shield: bool = False,
    ) -> T:
        """Run ``fn``; cancelled (and EngineDeadError raised) if the executor dies meanwhile
        (``Lifeline.call``)."""
        self.check_health()
        try:
            with self._life.call(limit_s, shield):
                return await fn(*args)
        except trio.TooSlowError:
            raise self._fail(
                EngineDeadError(f"Workers did not {what} within {limit_s} s.")
            ) from None
        except IPCError as exc:
            raise self._fail(
                EngineDeadError(f"Worker link broken while trying to {what}: {exc}")
            ) from exc
        raise self._life.death()

    def check_health(self) -> None:
        self._life.check(started=self._ipc is not None)

    # ------------------------------------------------------------ P2 / P3

    async def execute_model(self, sched: SchedulerOutput) -> None:
        self.check_health()
        frame = codec.encode(sched)
        self._steps.add(sched, None)
        what = f"take step {sched.step_id}"
        await self._guarded(self.ipc.requests.send, self.step_timeout_s, what, frame, shield=True)

    async def sample_tokens(self, req: SampleRequest | None) -> ModelRunnerOutput:
        await self.start_sampling(req)
        return await self.collect_step()

    async def start_sampling(self, req: SampleRequest | None) -> None:
        self.check_health()
        sample = self._steps.start_sampling(req)
        if sample is not None:
            what = f"sample step {sample.step_id}"
            frame = codec.encode(sample)
            await self._guarded(
                self.ipc.requests.send, self.step_timeout_s, what, frame, shield=True
            )

    async def collect_step(self) -> ModelRunnerOutput:
        self.check_health()
        sched, _ = self._steps.collect()
        what = f"answer step {sched.step_id}"
        try:
            outputs = await self._guarded(self._collect, self.step_timeout_s, what, sched.step_id)
            return stage_times(step_output(outputs, self.output_rank), outputs, self.output_rank)
        except WorkerStepProtocolError as exc:
            raise self._fail(EngineDeadError(str(exc))) from None

    async def _collect(self, step_id: int) -> list[ModelRunnerOutput]:
        # NOTE: the rings, not a callback: worker_steps never calls back into this module
        rings = [(rank, self._reader(rank)) for rank in self._read_order]
        return await collect_step_outputs(rings, self.world_size, step_id, self._exits)

    # ------------------------------------------------------------ collective_rpc

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        frame = self._steps.call_frame(method, args, kwargs)
        what = f"answer collective_rpc {method!r}"
        await self._guarded(self.ipc.requests.send, self.step_timeout_s, what, frame, shield=True)
        try:
            return await self._guarded(self._collect_calls, self.step_timeout_s, what)
        except WorkerCallProtocolError as exc:
            raise self._fail(EngineDeadError(str(exc))) from None

    async def _collect_calls(self) -> list[Any]:
        return await collect_call_results(self._reader, self._read_order, self.world_size)

    async def shutdown(self) -> None:
        self._stop.set()
        if self._ipc is not None:
            await self._stopped.wait()
        self._life.shut_down()
