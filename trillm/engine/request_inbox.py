"""A request's way into the engine (``interfaces.RequestEngine``): stage 2's preprocessor, the
adapter and grammar checks, and the output handler's inbox (new requests and aborts), with
the error the engine died of.

``AsyncEngine`` builds one and hands it to each ``ParentRequest`` it makes
(``request_stream.py``). It sits below both: a parent request submits by calling down into
this module, never back into the engine module that created it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import trio

from trillm.engine.preprocess import InvalidRequestError, Preprocessor
from trillm.errors import EngineDeadError
from trillm.lora.request import LoRARequest
from trillm.messages import AbortRequest, AddRequest, OutputHandlerInput
from trillm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from trillm.lora.checker import LoRAChecker
    from trillm.structured_output.manager import StructuredOutputManager


class RequestInbox:
    """What a request needs of the engine; ``dead_error`` is set once, when the engine dies."""

    def __init__(
        self,
        send: trio.MemorySendChannel[OutputHandlerInput],  # the output handler's inbox
        preprocessor: Preprocessor,
        stream_interval: int,
        lora_checker: LoRAChecker | None,  # None without --enable-lora
        structured_output: StructuredOutputManager,
    ) -> None:
        self._send = send
        self.preprocessor = preprocessor
        self.stream_interval = stream_interval
        self._lora_checker = lora_checker
        self._structured_output = structured_output
        self.dead_error: EngineDeadError | None = None

    def check_alive(self) -> None:
        if self.dead_error is not None:
            raise self.dead_error

    async def check_lora(self, lora: LoRARequest) -> None:
        """InvalidRequestError (a 400) unless LoRA is on and the adapter fits the model."""
        if self._lora_checker is None:
            raise InvalidRequestError(
                "LoRA adapters need the engine started with enable_lora (--enable-lora).",
                "lora_request",
            )
        await self._lora_checker.check(lora)

    async def compile_grammar(self, params: SamplingParams) -> None:
        """Structured outputs: compiled before the engine sees the request, so a bad spec is
        refused here, a 400 (``StructuredOutputManager.precompile``)."""
        await self._structured_output.precompile(params.structured_outputs)

    def try_send_to_handler(self, msg: AddRequest) -> bool:
        """Hand a new request to the output handler without waiting: False when its inbox
        is full."""
        try:
            self._send.send_nowait(msg)
        except trio.WouldBlock:
            return False
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self.dead_error or EngineDeadError("The engine has shut down.") from None
        return True

    async def send_to_handler(self, msg: AddRequest) -> None:
        """Hand a new request to the output handler (waits while its inbox is full)."""
        try:
            await self._send.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            raise self.dead_error or EngineDeadError("The engine has shut down.") from None

    async def send_abort(self, msg: AbortRequest) -> None:
        """Abort through the output handler; nothing to do once the engine is gone."""
        try:
            await self._send.send(msg)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
