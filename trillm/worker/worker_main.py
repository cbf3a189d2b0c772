"""The model-worker process: ``python -m trillm.worker.worker_main --rank R --request-ring ...``.

It attaches to the executor's rings (names and eventfds on the command line; the eventfds and
the parent-death pipe are inherited through ``pass_fds``), receives ``InitWorker`` (the config
as plain data and the runner spec), then serves steps until ``Shutdown``:

    SchedulerOutput  -> runner.execute_model(sched); unless wait_for_bitmask, sample at once
    SampleRequest    -> runner.sample_tokens(bitmask)
    WorkerCall       -> worker_rpc.call(runner, ...) -> WorkerCallResult (between steps)
    every sample     -> ModelRunnerOutput on this rank's result ring

A step whose execute or sample raises is answered with ``ModelRunnerOutput.error`` (the
traceback) and the worker carries on; the executor turns it into ``ModelExecutionError``.
A failure outside a step (init, a corrupt ring) is answered with ``WorkerFailed`` and exit 1;
so is a tensor-parallel collective that timed out (``CollectiveTimeoutError``), whatever the
step: the group is unusable after it.

Parent death: a daemon thread blocks on the read end of a pipe whose write end only the parent
holds; EOF means the parent is gone and the process exits at once (even mid-forward). The ring
waits also check ``os.getppid()``. (``PR_SET_PDEATHSIG`` is not used: it fires when the parent
*thread* that forked exits, and Trio spawns processes from its reusable worker threads.)
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import sys
import threading
import traceback
from typing import TYPE_CHECKING

from trillm._native import park_thread_pools
from trillm.distributed import expert_step_faults
from trillm.distributed.expert_parallel import load as expert_load
from trillm.distributed.expert_parallel import traffic as expert_traffic
from trillm.distributed.parallel_state import adopt_rendezvous_listener
from trillm.errors import CodecError, CollectiveTimeoutError, IPCError, RingClosedError
from trillm.gc_heap import freeze_startup_heap
from trillm.interfaces import ModelRunnerProtocol, PendingStepRunner, RunnerClass
from trillm.ipc import codec
from trillm.ipc.control import (
    InitKVCache,
    InitWorker,
    Shutdown,
    WorkerCall,
    WorkerCallResult,
    WorkerFailed,
    WorkerReady,
)
from trillm.ipc.shm_ring import RingReader, RingWriter
from trillm.ipc.shm_segment import RingFds, ShmRing
from trillm.messages import ModelRunnerOutput, SampleRequest, SchedulerOutput
from trillm.worker import worker_rpc
from trillm.worker.remote_rank import check_same_config, join_from_node, with_frontend_choices
from trillm.worker.step_timing import ExecuteClock

if TYPE_CHECKING:
    from trillm.config import TrillmConfig
    from trillm.distributed.node_link import NodeLink

EXIT_OK, EXIT_FAILED, EXIT_PARENT_DIED = 0, 1, 3


class ParentDiedError(RuntimeError):
    pass


def load_runner_class(spec: str) -> RunnerClass:
    """``"package.module:ClassName"`` -> the class."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"Runner spec {spec!r} must look like 'package.module:ClassName'.")
    runner_cls: RunnerClass = getattr(importlib.import_module(module_name), attr)
    return runner_cls


def _watch_death_pipe(fd: int) -> None:
    def wait() -> None:
        while True:
            try:
                if not os.read(fd, 64):
                    break
            except InterruptedError:
                continue
            except OSError:
                break
        os._exit(EXIT_PARENT_DIED)

    threading.Thread(target=wait, name="parent-death-watch", daemon=True).start()


class Worker:
    """One rank's message loop. On node 0 it reads the executor's request ring and writes its
    result ring; rank 0 of a multi-node world also relays (``link``, ``node_link.py``): it
    forwards each message to the other nodes' ranks before acting on it and writes their
    replies after its own. A rank on another node (``requests`` None) reads and answers
    through ``link`` alone."""

    def __init__(
        self,
        rank: int,
        requests: RingReader | None,
        results: RingWriter | None,
        parent_pid: int,
        link: NodeLink | None = None,
        own_config: TrillmConfig | None = None,
    ):
        self.rank = rank
        self.requests = requests
        self.results = results
        self.parent_pid = parent_pid
        self.link = link
        self.own_config = own_config  # a remote rank's config, built from its node's flags
        self.runner: ModelRunnerProtocol | None = None  # set by InitWorker
        self._sched: SchedulerOutput | None = None
        self._step_error: str | None = None
        self._lost: dict[str, str] = {}  # -dp N -ep: requests this step fails alone
        self.execute_clock = ExecuteClock(False)  # --collect-detailed-traces worker

    def _check_parent(self) -> None:
        if os.getppid() != self.parent_pid:
            raise ParentDiedError(f"Worker rank {self.rank}: parent {self.parent_pid} is gone.")

    def _idle(self) -> None:
        self._check_parent()
        if self.link is not None:
            self.link.heartbeat_if_idle()

    def _send(self, msg: codec.Message, timeout: float | None = None) -> None:
        """This rank's reply (and, on a relaying rank 0, the other nodes' replies after it)."""
        frame = codec.encode(msg)
        if self.results is None:
            assert self.link is not None
            self.link.send_reply(frame)
            return
        self.results.send_sync(frame, timeout, idle_check=self._check_parent)
        if self.link is not None:
            for reply in self.link.replies():
                self.results.send_sync(reply, timeout, idle_check=self._check_parent)

    def send_failure(self, msg: WorkerFailed) -> None:
        """Last words: to the executor's ring (node 0) or to rank 0 (another node)."""
        frame = codec.encode(msg)
        if self.results is not None:
            self.results.send_sync(frame, 5.0, idle_check=self._check_parent)
        elif self.link is not None and not msg.collective:
            self.link.send_reply(frame)

    def _recv(self) -> codec.Message:
        if self.requests is None:
            assert self.link is not None
            return codec.decode(self.link.receive())
        frame = self.requests.recv_sync(idle_check=self._idle)
        msg = codec.decode(frame)
        if isinstance(msg, InitWorker) and msg.config.parallel.nnodes > 1 and self.rank == 0:
            # Rank 0 joins the world first: the other nodes' ranks wait for this frame in it.
            from trillm.distributed.node_link import NodeLink
            from trillm.distributed.parallel_state import get_tp_group
            from trillm.distributed.worker import join_tensor_parallel

            join_tensor_parallel(msg.config, self.rank)
            self.link = NodeLink(get_tp_group(), msg.config.parallel.remote_ranks())
        if self.link is not None:
            self.link.broadcast(frame)
        return msg

    def run(self) -> int:
        """Serve messages until Shutdown; returns the exit code."""
        while True:
            try:
                msg = self._recv()
            except RingClosedError:
                return EXIT_OK
            if isinstance(msg, Shutdown):
                if self.runner is not None:
                    self.runner.shutdown()
                return EXIT_OK
            self._handle(msg)

    def _handle(self, msg: codec.Message) -> None:
        if isinstance(msg, SchedulerOutput):
            self._execute(msg)
            if not msg.wait_for_bitmask:
                self._sample(None)
        elif isinstance(msg, SampleRequest):
            self._sample(msg.bitmask)
        elif isinstance(msg, WorkerCall):
            self._send(self._call(msg))
        elif isinstance(msg, InitWorker):
            config = msg.config
            if self.own_config is not None:  # another node: its flags must agree with node 0's
                check_same_config(config, self.own_config)
                config = with_frontend_choices(self.own_config, config)
            self.execute_clock = ExecuteClock(config.collect_model_execute_time)
            runner: ModelRunnerProtocol = load_runner_class(msg.runner)(
                config, self.rank, **msg.runner_kwargs
            )
            self.runner = runner
            runner.load_model()
            num_blocks = runner.determine_num_blocks()
            self._send(WorkerReady(self.rank, "loaded", num_blocks))
        elif isinstance(msg, InitKVCache):
            self._loaded().initialize_kv_cache(msg.num_blocks)
            freeze_startup_heap(f"worker rank {self.rank}")  # started: the model and cache are in
            self._send(WorkerReady(self.rank, "kv_cache", msg.num_blocks))
        else:
            raise CodecError(f"Worker rank {self.rank} got unexpected {type(msg).__name__}.")

    def _call(self, msg: WorkerCall) -> WorkerCallResult:
        """One collective_rpc call; its failure is answered, the rank carries on."""
        try:
            value = worker_rpc.call(self._loaded(), msg.method, msg.args, msg.kwargs)
        except CollectiveTimeoutError:
            raise
        except Exception as exc:
            return WorkerCallResult(self.rank, None, f"{type(exc).__name__}: {exc}")
        result = WorkerCallResult(self.rank, value)
        try:
            codec.encode(result)
        except CodecError as exc:  # a result that is not plain data
            return WorkerCallResult(self.rank, None, f"collective_rpc {msg.method!r}: {exc}")
        return result

    def _loaded(self) -> ModelRunnerProtocol:
        if self.runner is None:
            raise CodecError(f"Worker rank {self.rank} got a step before InitWorker.")
        return self.runner

    def _execute(self, sched: SchedulerOutput) -> None:
        self._sched, self._step_error, self._lost = sched, None, {}
        layers_before = expert_traffic.layers_done
        config = getattr(self.runner, "config", None)
        span = config is not None and config.parallel.experts_span_cores
        if span:
            expert_step_faults.start_forward()
        try:
            self.execute_clock.run(self._loaded().execute_model, sched)
        except CollectiveTimeoutError:
            raise  # the group is broken: fatal, not one step's failure
        except Exception:
            self._step_error = traceback.format_exc()
            if span:
                self._finish_expert_exchanges(expert_traffic.layers_done - layers_before)
        if span:
            self._agree_step()

    def _agree_step(self) -> None:
        """-dp N -ep: every rank's verdict on this step (``expert_step_faults``): failed
        whole, or only the requests whose tokens went to experts that failed."""
        device = getattr(self.runner, "device", "cpu")
        verdict = expert_step_faults.agree_step(self._step_error is not None, device)
        if self._step_error is not None:
            return
        lost, runner = None, self.runner
        step = runner.pending_step() if isinstance(runner, PendingStepRunner) else None
        if verdict.tokens is not None and step is not None:
            lost = expert_step_faults.requests_of(
                verdict, step.req_ids, step.inputs.query_start_loc
            )
        if verdict.reason is not None or (verdict.tokens is not None and lost is None):
            self._step_error = verdict.reason or verdict.why
        self._lost = lost or {}

    def _finish_expert_exchanges(self, done: int) -> None:
        """-dp N -ep: a forward that failed on this rank (one step's requests fail) before
        all its MoE layers exchanged would leave the other cores' ranks waiting in them: the
        rest run without tokens (``worker_rpc.expert_dummy_forward``)."""
        worker_rpc.call(self._loaded(), "expert_dummy_forward", [done], {"agree": False})

    def _sample(self, bitmask: dict[str, bytes | list[int]] | None) -> None:
        sched = self._sched
        if sched is None:
            raise CodecError(f"Worker rank {self.rank} got a SampleRequest without a step.")
        self._sched = None
        out = None
        if self._step_error is None:
            try:
                out = self.execute_clock.run(self._loaded().sample_tokens, bitmask)
            except Exception:
                self._step_error = traceback.format_exc()
        if out is not None and self._lost:
            out = expert_step_faults.without_requests(out, self._lost)
        if out is None:
            req_ids = list(sched.num_scheduled_tokens)
            out = ModelRunnerOutput(
                sched.step_id, req_ids, [[] for _ in req_ids], error=self._step_error
            )
        out.expert_load = expert_load.take()  # expert parallelism: the step's routing
        self.execute_clock.stamp(out)
        # NOTE: before the reply: until the next step the cores are the engine's and the HTTP
        # server's (the reply's outputs, the next schedule), not a pool thread's ~0.5 ms poll
        park_thread_pools()
        self._send(out)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="trillm model worker (started by the executor)")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--engine", type=int, default=0, help="engine core (data parallelism)")
    p.add_argument("--request-ring", help="JSON RingFds; this rank reads it")
    p.add_argument("--result-ring", help="JSON RingFds; this rank writes it")
    p.add_argument(
        "--engine-args",
        help="JSON EngineArgs of a headless node: this rank is on another "
        "node than the executor and talks to it through rank 0 (no rings)",
    )
    p.add_argument("--death-fd", type=int, required=True, help="read end of the parent pipe")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument(
        "--rendezvous-fd",
        type=int,
        help="rank 0: a TCP socket already listening on the tensor-parallel rendezvous port",
    )
    return p.parse_args(argv)


def _ring_fds(text: str) -> RingFds:
    d = json.loads(text)
    return RingFds(d["name"], list(d["data_fds"]), d["space_fd"])


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    # Ctrl-C and a process-group SIGTERM are the parent's to handle: it drains in-flight
    # requests, then shuts the workers down (and a dead parent closes the death pipe).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _watch_death_pipe(args.death_fd)
    if os.getppid() != args.parent_pid:
        return EXIT_PARENT_DIED
    if args.rendezvous_fd is not None:
        adopt_rendezvous_listener(args.rendezvous_fd)
    worker = Worker(args.rank, None, None, args.parent_pid)
    try:
        if args.engine_args is not None:
            worker.own_config, worker.link = join_from_node(json.loads(args.engine_args), args.rank)
        else:
            req_fds, res_fds = _ring_fds(args.request_ring), _ring_fds(args.result_ring)
            worker.requests = RingReader(ShmRing.attach(req_fds.name), args.rank, req_fds)
            worker.results = RingWriter(ShmRing.attach(res_fds.name), res_fds)
        return worker.run()
    except ParentDiedError:
        return EXIT_PARENT_DIED
    except Exception as exc:
        message = f"Worker rank {args.rank} failed: {exc}\n{traceback.format_exc()}"
        print(message, file=sys.stderr, flush=True)
        try:
            collective = isinstance(exc, CollectiveTimeoutError)
            worker.send_failure(WorkerFailed(args.rank, message, collective))
        except (IPCError, ParentDiedError, TimeoutError, CollectiveTimeoutError):
            pass
        return EXIT_FAILED


if __name__ == "__main__":
    code = main()
    # NOTE: no interpreter finalization: its last garbage collection over torch's objects took
    # ~3.5 s per worker, which every engine stop waited for, and nothing here needs it (the
    # executor unlinks the rings; the process group was destroyed on Shutdown).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
