"""The output-handler task: the one task that owns the output processor and, for that reason,
the one place requests are admitted into the engine cores.

Its bounded inbox carries, in order, three things: engine outputs (stage 10: detokenize, stop
strings, logprobs -> the readers' collectors), new requests (``AddRequest``) and aborts
(``AbortRequest``). A request must be registered in the output processor before its first
output can arrive, and an abort must find what it aborts, so admission runs in this task, in
inbox order: ``admit`` registers the request's output group and hands its engine requests to
the core the data-parallel router picks (``EngineCores.submit``, ``dp_router.py``); ``abort``
drops the group and tells the core that holds it. Both are named here apart from output
processing (``_on_outputs``), which they never touch.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from trillm.engine.engine_cores import EngineCores
from trillm.engine.output_processor import OutputProcessor
from trillm.engine.preprocess import InvalidRequestError
from trillm.errors import EngineDeadError
from trillm.messages import AbortRequest, AddRequest, EngineCoreOutputs, OutputHandlerInput


class OutputHandler:
    def __init__(
        self,
        processor: OutputProcessor,
        cores: EngineCores,
        step_observers: list[Callable[[int, int], None]],
        die: Callable[[BaseException], None],
        dead_error: Callable[[], EngineDeadError | None],
    ) -> None:
        self.processor = processor
        self.cores = cores
        self.step_observers = step_observers  # the engine's list (metrics append to it)
        self._die = die
        self._dead_error = dead_error

    async def run(
        self,
        inbox: trio.MemoryReceiveChannel[OutputHandlerInput],
        *,
        task_status: trio.TaskStatus = trio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        try:
            async for msg in inbox:
                self._handle(msg)
                # NOTE: everything already queued (parked senders included) is handled
                # before yielding again: a burst of new requests costs one scheduling round,
                # not one per request.
                while True:
                    try:
                        msg = inbox.receive_nowait()
                    except (trio.WouldBlock, trio.EndOfChannel):
                        break
                    self._handle(msg)
        except Exception as exc:
            self._die(exc)
            raise
        finally:
            self._fail_readers(inbox)

    def _handle(self, msg: OutputHandlerInput) -> None:
        if isinstance(msg, EngineCoreOutputs):
            self._on_outputs(msg)
        elif isinstance(msg, AddRequest):
            self.admit(msg)
        else:
            self.abort(msg)

    # ------------------------------------------------------------------ stage 10
    def _on_outputs(self, msg: EngineCoreOutputs) -> None:
        self.cores.note_outputs(msg)
        if msg.num_scheduled_tokens:
            for observe in self.step_observers:
                observe(msg.num_scheduled_tokens, msg.engine_index)
        to_abort = self.processor.process_outputs(msg.outputs, model_time_s=msg.model_time_s)
        if to_abort:
            self.cores.send_aborts(to_abort)

    # ------------------------------------------------------------------ admission
    def admit(self, msg: AddRequest) -> None:
        """Register the request's output group, then submit its engine requests to the core
        the router picks."""
        engine_ids = [r.request_id for r in msg.engine_requests]
        try:
            self.processor.add_request(
                msg.request_id,
                msg.prompt,
                msg.prompt_token_ids,
                msg.params,
                engine_ids,
                queue=msg.collector,
                arrival_time=msg.arrival_time,
            )
        except InvalidRequestError as exc:  # an id already in flight: this request alone
            msg.collector.put_error(exc)
            return
        index = self.cores.submit(msg.engine_requests)
        if index:
            self.processor.assign_engine(msg.request_id, index)

    def abort(self, msg: AbortRequest) -> None:
        ids = self.processor.child_ids(msg.request_id)
        if self.processor.abort_request(msg.request_id, msg.collector):
            self.cores.send_aborts(ids)

    # ------------------------------------------------------------------ the end
    def _fail_readers(self, inbox: trio.MemoryReceiveChannel[OutputHandlerInput]) -> None:
        """The handler ends (engine failure or shutdown): every reader gets the error, those
        whose request is still in the inbox included; later sends fail at once."""
        error = self._dead_error() or EngineDeadError("The engine has shut down.")
        self.processor.fail_all(error)
        while True:
            try:
                msg = inbox.receive_nowait()
            except (trio.WouldBlock, trio.EndOfChannel, trio.ClosedResourceError):
                break
            if isinstance(msg, AddRequest):
                msg.collector.put_error(error)
        inbox.close()
