"""Stage 10's hand-off: a one-slot mailbox per user request between the output handler and the
request's reader (the HTTP handler or an ``AsyncEngine.generate`` caller).

The collector holds at most one pending output: when its reader falls behind, new outputs are
merged into the pending one (DELTA concatenates, CUMULATIVE replaces), so the handler never
waits on a slow reader and memory per request stays bounded.
"""

from __future__ import annotations

import trio

from trillm.outputs import RequestOutput
from trillm.sampling_params import RequestOutputKind


class RequestOutputCollector:
    """A one-slot mailbox between the output handler (``put``) and a request's reader."""

    def __init__(
        self,
        output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE,
        stream_interval: int = 1,
    ) -> None:
        self._aggregate = output_kind == RequestOutputKind.DELTA
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = trio.Event()
        # DELTA only: wake the reader once this many tokens are pending (the first output and
        # the finish wake it at once), so busy streams get fewer, larger chunks.
        self._interval = stream_interval if self._aggregate else 1
        self._pending_tokens = 0
        self._delivered_any = False

    def put(self, output: RequestOutput) -> None:
        """Never blocks: merges into the pending output when the reader has not taken it."""
        if self._output is None:
            self._output = output
        else:
            self._output.add(output, aggregate=self._aggregate)
        if self._interval > 1:
            self._pending_tokens += sum(len(c.token_ids) for c in output.outputs)
            if (
                self._delivered_any
                and not output.finished
                and self._pending_tokens < self._interval
            ):
                return
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        """The reader gets ``error`` once the pending output is taken; a finished pending
        output wins (the request is complete, the error concerns the others)."""
        if self._output is not None and self._output.finished:
            return
        self._error = error
        self._ready.set()

    def get_nowait(self) -> RequestOutput | None:
        """The pending output (None if there is none); raises the error once drained."""
        output = self._output
        if output is not None and (self._ready.is_set() or output.finished):
            self._output = None
            self._pending_tokens = 0
            self._delivered_any = True
            if self._error is None:
                self._ready = trio.Event()
            return output
        if self._error is not None:
            raise self._error
        return None

    async def get(self) -> RequestOutput:
        while True:
            # NOTE: one scheduling point per output: a checkpoint when the output is already
            # there, else the wait itself (put or put_error sets the event it waits on).
            await self._ready.wait()
            output = self.get_nowait()
            if output is not None:
                return output
