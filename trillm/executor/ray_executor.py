"""RayExecutor (``--distributed-executor-backend ray``): each rank a Ray actor in a placement
group (``ray_cluster.py``), driven with the multiprocessing executor's step messages.

    engine --codec frame--> actor r.handle(frame)   (one Ray call per rank per message)
    actor r --[reply frames]--> the call's result   (ModelRunnerOutput, WorkerReady, ...)

The actor runs the worker process's message handling (``ray_actor.py``), so a rank behaves
as under the multiprocessing executor: the same runner, the same torch.distributed (gloo)
world between the actors (rank 0's actor binds the rendezvous port), the same outputs, which
``worker_steps.py`` checks as it does for the rings. Ray runs an actor's calls in submission
order, so up to ``max_concurrent_batches`` steps are in flight as with the rings.

Why Ray calls and not the shared-memory rings: a Ray actor is started by its raylet, not by
this process, so it cannot inherit the rings' eventfds; Ray calls also reach actors on other
nodes. Their cost per step is measured in ``benchmarks/README.md``.

Supervision: a task per rank keeps a ``ping`` call in flight; an actor that dies (killed,
its node gone) fails that call and the executor is dead: every in-flight and later call
raises ``EngineDeadError`` naming the rank, and the actors are killed. ``shutdown`` sends
``Shutdown``, kills the actors, removes the placement group and stops a cluster this engine
started (``RayCluster.close``).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import trio

from trillm.config import TrillmConfig
from trillm.errors import EngineDeadError, EngineStartupError
from trillm.executor.abstract import DEFAULT_RUNNER, Executor, RunnerFactory
from trillm.executor.bookkeeping import Lifeline, StepQueue, runner_name
from trillm.executor.multiproc import SHUTDOWN_GRACE_S, STARTUP_TIMEOUT_S, STEP_TIMEOUT_S
from trillm.executor.ray_cluster import RayCluster, rank_env, reclaim_signal_handlers
from trillm.executor.worker_calls import call_values
from trillm.executor.worker_ipc import worker_env
from trillm.executor.worker_steps import WorkerStepProtocolError, micro_batches, step_output
from trillm.ipc import codec
from trillm.ipc.control import (
    InitKVCache,
    InitWorker,
    Shutdown,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
)
from trillm.messages import ModelRunnerOutput, SampleRequest, SchedulerOutput
from trillm.utils import unwrap_group
from trillm.worker.step_timing import stage_times

T = TypeVar("T")

PROBE_INTERVAL_S = 0.5  # how often each rank's liveness ping is renewed
WAIT_SLICE_S = 0.2  # a thread waits on a Ray result this long at most, then checks for cancel


class RayExecutor(Executor):
    def __init__(
        self,
        config: TrillmConfig,
        runner_factory: RunnerFactory = DEFAULT_RUNNER,
        runner_kwargs: dict[str, Any] | None = None,
        *,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
        step_timeout_s: float | None = STEP_TIMEOUT_S,
    ) -> None:
        self.runner_spec = runner_name(runner_factory, "RayExecutor", "the rank actors")
        self.config = config
        parallel = config.parallel
        self.world_size = parallel.world_size
        self.output_rank = self.world_size - parallel.tensor_parallel_size
        self.runner_kwargs = runner_kwargs or {}
        self.startup_timeout_s = startup_timeout_s
        self.step_timeout_s = step_timeout_s
        self.num_blocks = 0
        self.cluster = RayCluster(self.world_size, config.device)
        self.worker_pids: list[int] = []  # each rank actor's process
        self.worker_nodes: list[str] = []  # each rank actor's Ray node id
        self.num_pipeline_stages = parallel.pipeline_parallel_size
        self.max_concurrent_batches = micro_batches(self.num_pipeline_stages)
        # with each step in flight: each of its messages' per-rank result refs
        self._steps: StepQueue[list[list[Any]]] = StepQueue(self.max_concurrent_batches)
        self._life = Lifeline()
        self._started = False
        self._stopping = False
        self._stop = trio.Event()
        self._stopped = trio.Event()

    # ------------------------------------------------------------ service

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        try:
            async with trio.open_nursery() as nursery:
                with trio.fail_after(self.startup_timeout_s):
                    await self._start(nursery)
                self._started = True
                task_status.started()
                await self._stop.wait()
                await self._stop_actors()
                nursery.cancel_scope.cancel()
        except trio.TooSlowError:
            raise EngineStartupError(
                f"The Ray rank actors did not start within {self.startup_timeout_s} s."
            ) from None
        except BaseExceptionGroup as group:
            raise unwrap_group(group) from None
        finally:
            self._stopping = True
            with trio.CancelScope(shield=True):
                await trio.to_thread.run_sync(self.cluster.close)
            self._life.shut_down()
            self._stopped.set()

    async def _start(self, nursery: trio.Nursery) -> None:
        await trio.to_thread.run_sync(self.cluster.open)
        reclaim_signal_handlers()  # ray.init's SIGTERM handler would abort a draining server
        env = rank_env(worker_env())
        actors = await trio.to_thread.run_sync(self.cluster.start_actors, env)
        places = await self._each([a.where.remote() for a in actors])
        self.worker_pids = [pid for _, _, pid in places]
        self.worker_nodes = [node_id for _, node_id, _ in places]
        here = await trio.to_thread.run_sync(_node_address)
        self.cluster.local_pids = [pid for address, _, pid in places if address == here]
        parallel = self.config.parallel
        if self.world_size > 1 and not parallel.master_port:
            ref = actors[0].bind_rendezvous.remote(parallel.master_addr)
            parallel.master_port = (await self._each([ref]))[0]
        for rank in range(self.world_size):
            nursery.start_soon(self._watch, rank)
        loaded = await self._control(InitWorker(self.config, self.runner_spec, self.runner_kwargs))
        self.num_blocks = min(r.num_blocks for r in loaded)
        self.config.cache.num_blocks = self.num_blocks
        await self._control(InitKVCache(self.num_blocks))

    async def _control(self, msg: InitWorker | InitKVCache) -> list[WorkerReady]:
        replies = await self._replies([self._submit(codec.encode(msg))])
        ready = [r for r in replies if isinstance(r, WorkerReady)]
        if len(ready) != self.world_size:
            raise self._fail(EngineStartupError(f"A rank actor answered {msg!r} with {replies}."))
        return ready

    async def _stop_actors(self) -> None:
        self._stopping = True
        if self._life.shut_down():
            with trio.move_on_after(SHUTDOWN_GRACE_S):
                refs = self._submit(codec.encode(Shutdown()))
                for ref in refs:
                    await _wait_ref(ref)

    async def _watch(self, rank: int) -> None:
        """Fail the executor once rank ``rank``'s actor is gone (a ping it cannot answer)."""
        actor = self.cluster.actors[rank]
        while True:
            try:
                await _get(actor.ping.remote())
            except Exception as exc:
                if not self._stopping:
                    error_type = EngineDeadError if self._started else EngineStartupError
                    self._fail(error_type(self._died(rank, exc)))
                return
            await trio.sleep(PROBE_INTERVAL_S)

    def _died(self, rank: int, exc: Exception) -> str:
        pid = self.worker_pids[rank] if rank < len(self.worker_pids) else "?"
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"Worker rank {rank} (Ray actor, pid {pid}) died: {first_line}"

    # ------------------------------------------------------------ calls

    def _submit(self, frame: bytes) -> list[Any]:
        """``frame`` to every rank's actor -> the per-rank result refs, by rank."""
        return [actor.handle.remote(frame) for actor in self.cluster.actors]

    async def _each(self, refs: list[Any]) -> list[Any]:
        values = []
        for rank, ref in enumerate(refs):
            try:
                values.append(await _get(ref))
            except Exception as exc:
                error_type = EngineDeadError if self._started else EngineStartupError
                raise self._fail(error_type(self._died(rank, exc))) from None
        return values

    async def _replies(self, submissions: list[list[Any]]) -> list[codec.Message]:
        """Each rank's replies to ``submissions`` (messages' per-rank refs), by rank then
        message; a rank's ``WorkerFailed`` is fatal."""
        by_rank: list[list[codec.Message]] = [[] for _ in range(self.world_size)]
        for refs in submissions:
            for rank, frames in enumerate(await self._each(refs)):
                by_rank[rank].extend(codec.decode(f) for f in frames)
        replies = [msg for msgs in by_rank for msg in msgs]
        for msg in replies:
            if isinstance(msg, WorkerFailed):
                error_type = EngineDeadError if self._started else EngineStartupError
                raise self._fail(error_type(f"Worker rank {msg.rank} failed:\n{msg.message}"))
        return replies

    # ------------------------------------------------------------ failure

    def _fail(self, error: EngineDeadError) -> EngineDeadError:
        """A rank is gone: every in-flight call is cancelled, ``run`` kills the actors."""
        if self._life.fail(error):
            self._stop.set()
        return self._life.death()

    async def wait_failed(self) -> EngineDeadError:
        return await self._life.wait_failed()

    def check_health(self) -> None:
        self._life.check(started=self._started)

    async def _guarded(self, fn: Callable[..., Awaitable[T]], what: str, *args: Any) -> T:
        """``fn`` cancelled (EngineDeadError raised) if the executor dies or the step timeout
        passes meanwhile."""
        self.check_health()
        limit = self.step_timeout_s
        try:
            with self._life.call(limit):
                return await fn(*args)
        except trio.TooSlowError:
            raise self._fail(EngineDeadError(f"Workers did not {what} within {limit} s.")) from None
        raise self._life.death()

    # ------------------------------------------------------------ P2 / P3

    async def execute_model(self, sched: SchedulerOutput) -> None:
        self.check_health()
        frame = codec.encode(sched)
        self._steps.add(sched, [self._submit(frame)])

    async def sample_tokens(self, req: SampleRequest | None) -> ModelRunnerOutput:
        await self.start_sampling(req)
        return await self.collect_step()

    async def start_sampling(self, req: SampleRequest | None) -> None:
        self.check_health()
        sample = self._steps.start_sampling(req)
        if sample is not None:
            self._steps.newest.append(self._submit(codec.encode(sample)))

    async def collect_step(self) -> ModelRunnerOutput:
        self.check_health()
        sched, submissions = self._steps.collect()
        what = f"answer step {sched.step_id}"
        replies = await self._guarded(self._replies, what, submissions)
        outputs = [r for r in replies if isinstance(r, ModelRunnerOutput)]
        try:
            if len(outputs) != self.world_size or any(o.step_id != sched.step_id for o in outputs):
                raise WorkerStepProtocolError(
                    f"The rank actors answered step {sched.step_id} with {replies}."
                )
            return stage_times(step_output(outputs, self.output_rank), outputs, self.output_rank)
        except WorkerStepProtocolError as exc:
            raise self._fail(EngineDeadError(str(exc))) from None

    async def collective_rpc(
        self, method: str, args: list[Any], kwargs: dict[str, Any]
    ) -> list[Any]:
        frame = self._steps.call_frame(method, args, kwargs)
        what = f"answer collective_rpc {method!r}"
        replies = await self._guarded(self._replies, what, [self._submit(frame)])
        return call_values([r for r in replies if isinstance(r, WorkerCallResult)])

    async def shutdown(self) -> None:
        self._stop.set()
        if self._started or self.cluster.actors:
            await self._stopped.wait()
        self._life.shut_down()


async def _wait_ref(ref: Any) -> None:
    """Until ``ref``'s result is ready, in slices of a thread each (a cancelled wait leaves no
    thread blocked in Ray behind, which ``ray.shutdown`` would have to wait out)."""
    import ray

    while True:
        ready, _ = await trio.to_thread.run_sync(
            lambda: ray.wait([ref], timeout=WAIT_SLICE_S, fetch_local=True)
        )
        if ready:
            return


async def _get(ref: Any) -> Any:
    """``ref``'s value (Ray's error if its call failed or its actor died)."""
    import ray

    await _wait_ref(ref)
    return await trio.to_thread.run_sync(ray.get, ref)


def _node_address() -> str:
    import ray

    address: str = ray.util.get_node_ip_address()
    return address
