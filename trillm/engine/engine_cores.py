"""Stage 4's engine cores behind one frontend: one per executor (``data_parallel_size`` K: K
of them, each with its own scheduler, KV cache, grammar matchers, LoRA admission and draft
proposer), their input channels, their last stats, and which core holds each request.

Owned by the output handler (``output_handler.OutputHandler``): it alone submits
requests (``submit``) and aborts (``send_aborts``) and notes each step's outputs
(``note_outputs``), so the router's counts and the inputs need no lock. The core tasks
(``core_loop.run_engine_core``) read their inputs and write their outputs to the handler's inbox.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import trio

from trillm.config import TrillmConfig
from trillm.engine.core_control import ControlledCore, CoreCall
from trillm.engine.dp_lockstep import CoreLockstep, ForwardCounter
from trillm.engine.dp_router import DataParallelRouter, sum_stats
from trillm.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    OutputHandlerInput,
    SchedulerStats,
)

if TYPE_CHECKING:
    from trillm.core.scheduler import Scheduler
    from trillm.engine.core import EngineCore
    from trillm.executor.abstract import Executor
    from trillm.spec_decode.draft_setup import DraftModelDrafts
    from trillm.spec_decode.ngram import NgramProposer
    from trillm.structured_output import StructuredOutputManager
    from trillm.tokenizer_protocol import Tokenizer

FailureHandler = Callable[[BaseException], None]


class EngineCores:
    def __init__(
        self,
        config: TrillmConfig,
        executors: list[Executor],
        structured_output: StructuredOutputManager,
    ) -> None:
        self.config = config
        self.executors = executors
        self.structured_output = structured_output  # the first core's
        self.cores = [self._make_core(ex, i) for i, ex in enumerate(executors)]
        # -dp N -ep: the cores' forwards in lock-step (dp_lockstep.py); None otherwise.
        self.lockstep: ForwardCounter | None = None
        if len(self.cores) > 1 and config.parallel.experts_span_cores:
            self.lockstep = ForwardCounter(len(self.cores))
            for index, core in enumerate(self.cores):
                core.lockstep = CoreLockstep(self.lockstep, index)
        # Which core takes each request (None with one core: everything goes to it).
        self.router = (
            DataParallelRouter(len(self.cores), config.cache.block_size)
            if len(self.cores) > 1
            else None
        )
        # Each core's input (new requests, aborts), written only by the output handler:
        # unbounded, yet what one holds is bounded by what came through the handler's bounded
        # inbox since the core last drained it (every step).
        inputs = [trio.open_memory_channel[Any](math.inf) for _ in self.cores]
        self._input_sends = [send for send, _ in inputs]
        self._input_recvs = [recv for _, recv in inputs]
        # Each core's last stats: zeros (and spec counters) until its first step.
        self.stats: list[SchedulerStats] = [core._stats() for core in self.cores]

    def close(self) -> None:
        """The engine stopped: each scheduler lets go of what it holds outside the engine's
        tasks (a KV connector's listeners and threads: ``ConnectorSteps.close``)."""
        for core in self.cores:
            close = getattr(core.scheduler, "close", None)
            if close is not None:
                close()

    # ------------------------------------------------------------------ status
    @property
    def num_blocks(self) -> int:
        """KV blocks of one engine core (the smallest: a request must fit any core)."""
        return min(executor.num_blocks for executor in self.executors)

    def summed_stats(self) -> SchedulerStats:
        """The scheduler stats, summed over the engine cores (KV usage: their mean)."""
        return self.stats[0] if len(self.stats) == 1 else sum_stats(self.stats)

    def longest_running_step(self) -> tuple[float, int]:
        """(seconds, core index) of the step that has run longest now; (0.0, 0) when no core
        is inside a step."""
        now = time.monotonic()
        steps = [(core.step_running_s(now), i) for i, core in enumerate(self.cores)]
        return max(steps, key=lambda step: step[0])

    def index_of(self, engine_ids: list[str]) -> int | None:
        """The core running the engine requests ``engine_ids`` (one user request's samples),
        None when none is known."""
        if self.router is None:
            return 0 if engine_ids else None
        for child in engine_ids:
            index = self.router.owner(child)
            if index is not None:
                return index
        return None

    # ------------------------------------------------------------------ requests
    def submit(self, requests: list[EngineCoreRequest]) -> int:
        """One user request's engine requests to the core the router picks: -> its index."""
        index = 0 if self.router is None else self.router.route(requests)
        send = self._input_sends[index]
        for request in requests:
            send.send_nowait(request)
        return index

    def send_aborts(self, engine_ids: list[str]) -> None:
        """Each abort to the engine core that holds the request."""
        if self.router is None:
            self._input_sends[0].send_nowait(AbortRequests(engine_ids))
            return
        by_core: dict[int, list[str]] = {}
        for req_id in engine_ids:
            index = self.router.release(req_id)
            if index is not None:
                by_core.setdefault(index, []).append(req_id)
        for index, ids in by_core.items():
            self._input_sends[index].send_nowait(AbortRequests(ids))

    def note_outputs(self, msg: EngineCoreOutputs) -> None:
        """A core's step: its stats, and (data parallelism) the router's loads follow what it
        finished."""
        if msg.scheduler_stats is not None:
            self.stats[msg.engine_index] = msg.scheduler_stats
        router = self.router
        if router is None:
            return
        if msg.scheduler_stats is not None:
            router.note_kv_usage(msg.engine_index, msg.scheduler_stats.kv_cache_usage)
        for out in msg.outputs:
            if out.finish_reason is not None:
                router.release(out.request_id)

    def post_calls(self, fn: Callable[[ControlledCore], Awaitable[Any]]) -> list[CoreCall]:
        """``fn(core)`` to be run by every engine core between its steps; -> the calls, by
        core, each answered once its ``done`` is set (core_control.py)."""
        calls = [CoreCall(fn) for _ in self.cores]
        for send, call in zip(self._input_sends, calls, strict=True):
            send.send_nowait(call)
        return calls

    # ------------------------------------------------------------------ tasks
    async def start(
        self,
        nursery: trio.Nursery,
        outputs: trio.MemorySendChannel[OutputHandlerInput],
        on_failure: FailureHandler,
    ) -> None:
        """Start each core's task (writing to ``outputs``, a clone each) and a watcher of
        each executor's workers; ``on_failure`` hears of a core or worker lost first."""
        for index in range(len(self.cores)):
            await nursery.start(self._run_core_task, index, outputs.clone(), on_failure)
        for executor in self.executors:
            nursery.start_soon(self._watch_workers, executor, nursery.cancel_scope, on_failure)

    async def _watch_workers(
        self, executor: Executor, tasks: trio.CancelScope, on_failure: FailureHandler
    ) -> None:
        """A worker lost while no step runs (another node gone, a killed rank) kills the
        engine now, not at the next request: /health answers 503 and the server stops. The
        readers get the error as the output handler ends (``tasks``: the cores and handler)."""
        on_failure(await executor.wait_failed())
        tasks.cancel()

    async def _run_core_task(
        self,
        index: int,
        outputs: trio.MemorySendChannel[OutputHandlerInput],
        on_failure: FailureHandler,
        *,
        task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED,
    ) -> None:
        from trillm.engine.core_loop import run_engine_core

        try:
            await run_engine_core(
                self.cores[index],
                self._input_recvs[index],
                outputs,
                index,
                task_status=task_status,
            )
        except Exception as exc:
            on_failure(exc)  # before the nursery cancels the handler: its readers get this
            raise
        finally:
            core = self.cores[index]
            if core.lockstep is not None:  # -dp N -ep: the others' last forwards still met
                await core.lockstep.settle(core.executor)

    # ------------------------------------------------------------------ construction
    def _make_core(self, executor: Executor, index: int) -> EngineCore:
        """An engine core on ``executor``: its own scheduler, grammar matchers (over the one
        grammar cache), LoRA admission and draft proposer."""
        from trillm.engine.core import EngineCore

        config = self.config
        scheduler = make_scheduler(config, executor.num_blocks)
        structured = self.structured_output
        if index > 0:
            from trillm.structured_output import StructuredOutputManager

            structured = StructuredOutputManager(
                structured.cache, config.reasoning_parser, config.structured_outputs
            )
        lora = None
        if config.lora is not None:
            from trillm.lora.admission import LoRAAdmission

            lora = LoRAAdmission(config.lora.max_loras)
        traces = None
        if config.collect_model_forward_time or config.collect_model_execute_time:
            from trillm.engine.core_traces import CoreTraces

            traces = CoreTraces(
                config.collect_model_forward_time, config.collect_model_execute_time
            )
        return EngineCore(scheduler, executor, structured, lora, _proposer(config), traces)


def make_scheduler(config: TrillmConfig, num_blocks: int) -> Scheduler:
    """An engine core's scheduler (the native one when built, else its twin), with the
    encoder budget and cache of a multimodal model (``core/encoder_cache.py``), keeping image
    spans whole when the model's image tokens attend both ways (``core/mm_spans.py``)."""
    from trillm._native import get_scheduler_cls
    from trillm.core.encoder_cache import encoder_cache_for
    from trillm.core.mm_spans import check_budget, whole_span_tokens

    if config.kv_transfer is not None or config.kv_offload is not None:
        from trillm.kv_transfer.scheduler_side import connector_scheduler

        scheduler: Scheduler = connector_scheduler(config, num_blocks)
    else:
        scheduler = get_scheduler_cls()(config.scheduler, config.cache, num_blocks)
    scheduler.encoder_cache = encoder_cache_for(config)
    span = whole_span_tokens(config)
    if span:
        check_budget(config, span)
        scheduler.keep_mm_spans_whole = True
    return scheduler


def structured_output_manager(
    config: TrillmConfig, tokenizer: Tokenizer
) -> StructuredOutputManager:
    """The grammar cache and matchers (xgrammar needs the tokenizer's vocabulary)."""
    from trillm.structured_output import GrammarCache, StructuredOutputManager

    cache = GrammarCache(
        tokenizer,
        config.model.vocab_size,
        list(config.model.eos_token_ids),
        cache_bytes=config.structured_outputs_cache_bytes,
    )
    return StructuredOutputManager(cache, config.reasoning_parser, config.structured_outputs)


def _proposer(config: TrillmConfig) -> NgramProposer | DraftModelDrafts | None:
    """The drafts' source when speculative decoding is configured, else None: the n-gram
    proposer, or the engine-side view of the worker's draft model."""
    from trillm.spec_decode.config import MODEL_METHODS

    spec = config.speculative
    if spec is None or config.pooler is not None:  # pooling: nothing to decode
        return None
    if spec.method in MODEL_METHODS:  # a draft model or an EAGLE head, in the worker
        from trillm.spec_decode.draft_setup import DraftModelDrafts

        return DraftModelDrafts(spec, config.scheduler.max_model_len)
    from trillm.spec_decode.ngram import NgramProposer

    return NgramProposer(spec, config.scheduler.max_model_len)
