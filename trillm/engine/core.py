"""The engine core: one Trio task running ``step()`` = schedule -> execute -> sample -> update.

It owns the scheduler (and through it every engine-side ``Request``); it talks to the frontend
only through channels: ``EngineCoreInput`` messages in, ``EngineCoreOutputs`` out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection
from typing import TYPE_CHECKING, cast

from trillm.engine.batch_queue import BatchQueue
from trillm.engine.core_control import CoreCall, CoreControl
from trillm.engine.core_grammars import CoreGrammars
from trillm.engine.core_multimodal import CoreMultimodal
from trillm.engine.core_speculation import CoreSpeculation
from trillm.errors import CodecError, ModelExecutionError
from trillm.ipc import codec
from trillm.messages import (
    AbortRequests,
    EngineCoreInput,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    FinishReason,
    ModelRunnerOutput,
    SchedulerOutput,
    SchedulerStats,
    SpecDecodingStats,
)

if TYPE_CHECKING:
    from trillm.core.scheduler import Scheduler
    from trillm.engine.core_traces import CoreTraces
    from trillm.engine.dp_lockstep import CoreLockstep
    from trillm.executor.abstract import Executor
    from trillm.kv_transfer.scheduler_side import ConnectorScheduler
    from trillm.lora.admission import LoRAAdmission
    from trillm.spec_decode.draft_setup import DraftModelDrafts
    from trillm.spec_decode.ngram import NgramProposer
    from trillm.structured_output import StructuredOutputManager

logger = logging.getLogger(__name__)


class EngineCore:
    def __init__(
        self,
        scheduler: Scheduler,
        executor: Executor,
        structured_output: StructuredOutputManager,
        lora: LoRAAdmission | None = None,
        proposer: NgramProposer | DraftModelDrafts | None = None,
        traces: CoreTraces | None = None,
    ) -> None:
        self.scheduler = scheduler
        # LoRAAdmission (trillm/lora/admission.py) with --enable-lora: holds requests whose
        # adapter would exceed max_loras, and attaches adapters to scheduled new requests.
        self.lora = lora
        self.mm = CoreMultimodal()  # multimodal items, attached to scheduled new requests
        self.control = CoreControl()  # sleep, pause and the frontend's calls (core_control.py)
        self.executor = executor
        # NgramProposer or DraftModelDrafts (trillm/spec_decode/) or None: drafts for the
        # next step, after P4 (core_speculation.py: the counters and the n-gram back-off).
        self.speculation = None if proposer is None else CoreSpeculation(proposer)
        # StructuredOutputManager (trillm/structured_output/): the grammar matchers.
        self.structured_output = structured_output
        # Ids the worker must drop that rode on a step that scheduled nothing.
        self._unsent_finished: list[str] = []
        self._refused: list[EngineCoreOutput] = []  # ended by the engine, to publish
        self.grammars = CoreGrammars(scheduler, structured_output, self._refused_append)
        # req_id -> time.time() of its first P1, until its first output carries it.
        self._scheduled_at: dict[str, float] = {}
        self.traces = traces  # --collect-detailed-traces: per-request model times
        self.num_steps = 0
        self.expert_load: list[int] = []  # expert parallelism: pairs per rank (cumulative)
        # time.monotonic() when the step now awaited began (None between steps): /health
        # reads it to tell a stopped or hung worker from a busy one (``step_running_s``).
        self.step_started: float | None = None
        # -dp N -ep: the forward counter this core keeps in step with (engine/dp_lockstep.py)
        self.lockstep: CoreLockstep | None = None
        # Pipeline parallelism: several steps in flight (None without pipeline stages).
        self.batch_queue: BatchQueue | None = None
        if executor.num_pipeline_stages > 1:
            self.batch_queue = BatchQueue(executor.max_concurrent_batches)

    def step_running_s(self, now: float) -> float:
        """How long the step now awaited has run at ``now`` (0 between steps)."""
        return 0.0 if self.step_started is None else now - self.step_started

    @property
    def spec_stats(self) -> SpecDecodingStats | None:
        return None if self.speculation is None else self.speculation.stats

    def _refused_append(self, out: EngineCoreOutput) -> None:
        self._refused.append(out)

    # ------------------------------------------------------------------ inputs
    def handle_input(self, msg: EngineCoreInput | CoreCall) -> None:
        if isinstance(msg, CoreCall):
            self.control.pending.append(msg)  # run between steps by run_engine_core
        elif isinstance(msg, EngineCoreRequest):
            if self.control.hold(msg):
                return  # pause(mode="wait") is draining: admitted at the resume
            if self.lora is not None and not self.lora.offer(msg):
                return  # held until one of the running adapters is free
            self._add_request(msg)
        elif isinstance(msg, AbortRequests):
            ids = msg.request_ids
            self.control.forget_held(ids)
            if self.lora is not None and self.lora.has_held:
                held = self.lora.abort_held(ids)
                self._refused += [
                    EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in held
                ]
            self.scheduler.finish_requests(ids, FinishReason.ABORT)
        else:  # pragma: no cover - messages are typed
            raise TypeError(f"unexpected engine input {type(msg).__name__}")

    def _add_request(self, msg: EngineCoreRequest) -> None:
        try:
            self.scheduler.add_request(msg)
        except ValueError as exc:
            # The frontend checks admission first; a request that still does not fit ends
            # at once instead of wedging the queue.
            logger.warning("request %s refused by the scheduler: %s", msg.request_id, exc)
            if self.lora is not None:
                self.lora.forget(msg.request_id)
            self._refused.append(
                EngineCoreOutput(msg.request_id, [], None, None, FinishReason.ABORT, None)
            )
        else:
            self.mm.add(msg)
            if msg.sampling_params.structured_outputs is not None:
                self.grammars.add(msg)

    @property
    def has_refused(self) -> bool:
        """Outputs to publish or LoRA-held requests to admit without any new input."""
        return bool(self._refused) or (self.lora is not None and self.lora.has_held)

    # ------------------------------------------------------------------ step
    async def step(self) -> EngineCoreOutputs | None:
        if self.batch_queue is not None:
            return await self._step_with_batch_queue(self.batch_queue)
        t0 = time.perf_counter()
        refused = self._before_schedule()
        sched = self._schedule()  # P1
        if sched.total_num_scheduled_tokens == 0:
            self._unsent_finished.extend(sched.finished_req_ids)
            if refused or sched.finished_req_ids:  # aborts changed the stats: publish them
                return EngineCoreOutputs(refused, time.monotonic(), self._stats())
            return None
        self._attach_unsent_finished(sched)
        refused += await self._execute(sched)  # P2, runs in the worker
        if sched.total_num_scheduled_tokens == 0:  # every request of the step was refused
            self._unsent_finished.extend(sched.finished_req_ids)
            return EngineCoreOutputs(refused, time.monotonic(), self._stats())
        sample_req = self.grammars.bitmask(sched)  # overlaps P2
        try:
            runner_out = await self.executor.sample_tokens(sample_req)  # P3
        except ModelExecutionError as exc:
            return self._fail_step(sched, exc, refused)
        return self._apply_output(sched, runner_out, refused, t0)

    def _before_schedule(self) -> list[EngineCoreOutput]:
        """Grammars compiled, LoRA-held requests admitted; -> the refused outputs to publish."""
        self.grammars.poll()
        self.mm.release(lambda req_id: self.scheduler.get_request(req_id) is not None)
        if self.lora is not None:
            get = self.scheduler.get_request
            for req in self.lora.release(lambda req_id: get(req_id) is not None):
                self._add_request(req)
        refused, self._refused = self._refused, []
        return refused

    def _schedule(self, busy: Collection[str] = (), max_reqs: int = 0) -> SchedulerOutput:
        if busy or max_reqs:
            sched = self.scheduler.schedule(busy, max_reqs)
        else:
            sched = self.scheduler.schedule()
        if self.lora is not None:
            self.lora.attach(sched.scheduled_new_reqs)
        self.mm.attach(sched.scheduled_new_reqs)
        self._note_scheduled(sched)
        return sched

    def _apply_output(
        self,
        sched: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        refused: list[EngineCoreOutput],
        t0: float,
    ) -> EngineCoreOutputs:
        """P4: the step's tokens into the scheduler, the grammars and the drafts."""
        failed = runner_out.failed
        if failed and self.batch_queue is not None:  # not a replaced request's (batch_queue.py)
            failed = {r: why for r, why in failed.items() if r in sched.num_scheduled_tokens}
        if failed:
            refused += self._fail_requests(failed, "taken by the worker")
        if runner_out.kv_load_failed:  # NOTE: only a KV connector's scheduler asks for loads
            scheduler = cast("ConnectorScheduler", self.scheduler)
            scheduler.recompute_failed_loads(runner_out.kv_load_failed)
        if runner_out.kv_offload_seconds:  # NOTE: only the KV offload tier times its copies
            cast("ConnectorScheduler", self.scheduler).kv_transfer_seconds(
                runner_out.kv_offload_seconds
            )
        outputs = self.scheduler.update_from_output(sched, runner_out)  # P4
        if self.batch_queue is not None:
            self.batch_queue.keep_tokens(sched, runner_out, self.scheduler.get_request)
        self.grammars.advance(outputs)
        self._stamp_scheduled(outputs)
        if self.traces is not None:
            self.traces.step(sched, runner_out, outputs)
        if runner_out.expert_load:
            load = self.expert_load or [0] * len(runner_out.expert_load)
            self.expert_load = [a + b for a, b in zip(load, runner_out.expert_load)]
        if runner_out.pooler_output:
            for out in outputs:
                out.pooled = runner_out.pooler_output.get(out.request_id)
        if self.speculation is not None:
            busy = () if self.batch_queue is None else self.batch_queue.busy()
            self.speculation.after_step(self.scheduler, sched, runner_out, busy)
        self.num_steps += 1
        return EngineCoreOutputs(
            outputs=refused + outputs if refused else outputs,
            timestamp=time.monotonic(),
            scheduler_stats=self._stats(),
            step_time_s=time.perf_counter() - t0,
            model_time_s=runner_out.model_time_s,
            num_scheduled_tokens=sched.total_num_scheduled_tokens,
        )

    # ------------------------------------------------------------------ batch queue (PP)
    @property
    def num_in_flight(self) -> int:
        """Steps sent whose outputs are not applied yet (pipeline parallelism only)."""
        return 0 if self.batch_queue is None else len(self.batch_queue)

    async def _step_with_batch_queue(self, queue: BatchQueue) -> EngineCoreOutputs | None:
        """Pipeline parallelism (vLLM's batch queue): while fewer than
        ``max_concurrent_batches`` steps are in flight, schedule one over its share of the
        requests that no in-flight step holds and send it; once the queue is full, or nothing
        more could be scheduled, wait for the oldest step and apply its output (outputs in
        step order)."""
        t0 = time.perf_counter()
        refused = self._before_schedule()
        sent, finished = False, False
        if not queue.full:
            live = sum(self.scheduler.get_request_counts())
            sched = self._schedule(queue.busy(), queue.share(live))  # P1
            finished = bool(sched.finished_req_ids)
            if sched.total_num_scheduled_tokens == 0:
                self._unsent_finished.extend(sched.finished_req_ids)
            else:
                sent = await self._submit(queue, sched, refused)
        if len(queue) and (not sent or queue.full):
            get = self.scheduler.get_request
            try:  # NOTE: the oldest step stays in the queue (and in flight) until it answers
                runner_out = await self.executor.collect_step()  # P3
            except ModelExecutionError as exc:
                return self._fail_step(queue.pop_oldest(get), exc, refused)
            return self._apply_output(queue.pop_oldest(get), runner_out, refused, t0)
        if refused or finished:  # aborts changed the stats: publish them
            return EngineCoreOutputs(refused, time.monotonic(), self._stats())
        return None

    async def _submit(
        self, queue: BatchQueue, sched: SchedulerOutput, refused: list[EngineCoreOutput]
    ) -> bool:
        """P2 and P3's trigger of one step, which joins the queue; the other stages get the
        tokens sampled since the last step with it. -> False when every request of it was
        refused (nothing was sent)."""
        self._attach_unsent_finished(sched)
        sched.pp_sampled_token_ids = queue.take_tokens()
        refused += await self._execute(sched)  # P2, runs in the workers
        if sched.total_num_scheduled_tokens == 0:
            self._unsent_finished.extend(sched.finished_req_ids)
            queue.give_back_tokens(sched.pp_sampled_token_ids)
            return False
        await self.executor.start_sampling(self.grammars.bitmask(sched))
        queue.push(sched, self.scheduler.get_request)
        return True

    def _note_scheduled(self, sched: SchedulerOutput) -> None:
        """The first P1 of each request (vLLM's SCHEDULED event): queue time ends here."""
        if sched.scheduled_new_reqs:
            now = time.time()
            for r in sched.scheduled_new_reqs:
                self._scheduled_at.setdefault(r.req_id, now)
        for req_id in sched.finished_req_ids:  # aborted before any output
            self._scheduled_at.pop(req_id, None)
        if self.traces is not None:
            self.traces.forget(sched.finished_req_ids)

    def _stamp_scheduled(self, outputs: list[EngineCoreOutput]) -> None:
        if self._scheduled_at:
            for out in outputs:
                out.scheduled_time = self._scheduled_at.pop(out.request_id, None)

    async def _execute(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Sends the step to the worker. A new request whose data cannot be encoded fails
        alone: it is taken out of the step and the rest is sent."""
        try:
            await self._send_step(sched)
            return []
        except CodecError:
            bad = {
                r.req_id: "encoded"
                for r in sched.scheduled_new_reqs
                if not codec.new_request_encodes(r)
            }
            if not bad:
                raise  # not one request's fault: the engine cannot go on
        failed = self._fail_requests(bad, "encoded")
        sched.scheduled_new_reqs = [r for r in sched.scheduled_new_reqs if r.req_id not in bad]
        for req_id in bad:
            sched.total_num_scheduled_tokens -= sched.num_scheduled_tokens.pop(req_id)
        if sched.total_num_scheduled_tokens:
            await self._send_step(sched)
        return failed

    async def _send_step(self, sched: SchedulerOutput) -> None:
        await self.executor.execute_model(sched)
        if self.lockstep is not None:
            self.lockstep.note_sent()

    def _fail_requests(self, why: dict[str, str], what: str) -> list[EngineCoreOutput]:
        """Ends the requests that could not be encoded or taken by the worker (req_id -> why):
        their own parameters did it, so they alone end."""
        for req_id, reason in why.items():
            logger.error(
                "request %s could not be %s; it alone is aborted: %s", req_id, what, reason
            )
        self.scheduler.finish_requests(list(why), FinishReason.ABORT)
        return [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in why]

    def _fail_step(
        self, sched: SchedulerOutput, exc: ModelExecutionError, refused: list[EngineCoreOutput]
    ) -> EngineCoreOutputs:
        """A step failed inside a live worker: end that step's requests, keep serving."""
        logger.error("step %d failed in the worker; aborting its requests: %s", sched.step_id, exc)
        req_ids = list(sched.num_scheduled_tokens)
        self.scheduler.finish_requests(req_ids, FinishReason.ABORT)
        failed = [EngineCoreOutput(r, [], finish_reason=FinishReason.ABORT) for r in req_ids]
        return EngineCoreOutputs(refused + failed, time.monotonic(), self._stats())

    def _stats(self) -> SchedulerStats:
        """The scheduler's stats, with the LoRA adapters and the speculative-decoding counters
        when configured."""
        stats = self.scheduler.get_stats()
        stats.num_deferred_waiting_reqs = self.grammars.num_waiting()
        stats.expert_load = list(self.expert_load)
        if self.lora is not None:
            stats.running_lora_adapters, stats.waiting_lora_adapters = self.lora.adapter_counts(
                self.scheduler.running_req_ids(), self.scheduler.waiting_req_ids()
            )
        if self.speculation is not None:
            stats.spec_decoding = self.speculation.snapshot()
        return stats

    def _attach_unsent_finished(self, sched: SchedulerOutput) -> None:
        if self._unsent_finished:
            sched.finished_req_ids = self._unsent_finished + list(sched.finished_req_ids)
            self._unsent_finished = []
