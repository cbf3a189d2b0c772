"""Stage 10's hand-off: a one-slot mailbox per user request between the output handler and the
request's reader (the HTTP handler or an ``AsyncEngine.generate`` caller).

The collector holds at most one pending output: when its reader falls behind, new outputs are
merged into the pending one (DELTA concatenates, CUMULATIVE replaces), so the handler never
waits on a slow reader. What a DELTA collector holds unread grows while its reader is behind;
past ``MAX_UNREAD_UNITS`` ``put`` reports it, and the output processor ends the request (a
client that stopped reading its stream must not make the server hold ever more output).
"""

from __future__ import annotations

from collections import deque

import trio

from trillm.outputs import RequestOutput
from trillm.sampling_params import RequestOutputKind

# What a stream's reader may leave unread before its request is aborted, in units of one token,
# one logprob entry or one character of text. A unit costs the server ~165 bytes of Python
# objects (measured: a stuck n=32 / 20-logprob stream grew the RSS 212 MiB for 1.34 M units),
# so 2**17 units hold ~20 MB. A reading client never gets there: it is a few steps behind at
# most (the wake budget holds its news in the processor, not here), and one streaming n=64
# with 20 logprobs from a model with no cost kept up even with an 8x smaller bound
# (tests/fault/test_slow_reader.py). Without logprobs, 2**17 tokens are more than a context.
MAX_UNREAD_UNITS = 1 << 17


def output_units(output: RequestOutput) -> int:
    """The size proxy of an output: tokens x (1 + logprobs per token) + characters of text."""
    units = 0
    for c in output.outputs:
        per_token = 1 + (len(c.logprobs[0]) if c.logprobs else 0)
        units += len(c.token_ids) * per_token + len(c.text)
    return units


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
        self.unread_units = 0  # DELTA only: the size of the pending output (output_units)
        self.overflowed = False  # the reader left MAX_UNREAD_UNITS unread once
        # Noted whenever the reader may take something: (the parent request's queue, this
        # prompt's index), for a parent reading several collectors in one task.
        self.ready_queue: tuple[ReadyQueue, int] | None = None

    def put(self, output: RequestOutput) -> bool:
        """Never blocks: merges into the pending output when the reader has not taken it.
        Returns True once (the first time) the unread output passes ``MAX_UNREAD_UNITS`` on an
        unfinished request: its owner must end the request."""
        if self._output is None:
            self._output = output
        else:
            self._output.add(output, aggregate=self._aggregate)
        over = False
        if self._aggregate:
            # NOTE: CUMULATIVE and FINAL_ONLY replace the pending output: a slow reader does
            # not make them hold more, so only DELTA is measured.
            self.unread_units += output_units(output)
            if self.unread_units > MAX_UNREAD_UNITS and not output.finished and not self.overflowed:
                self.overflowed = over = True
        if self._interval > 1:
            self._pending_tokens += sum(len(c.token_ids) for c in output.outputs)
            if (
                self._delivered_any
                and not output.finished
                and self._pending_tokens < self._interval
                and not over
            ):
                return over
        self._wake()
        return over

    def put_error(self, error: BaseException) -> None:
        """The reader gets ``error`` once the pending output is taken; a finished pending
        output wins (the request is complete, the error concerns the others)."""
        if self._output is not None and self._output.finished:
            return
        self._error = error
        self._wake()

    def _wake(self) -> None:
        self._ready.set()
        if self.ready_queue is not None:
            queue, index = self.ready_queue
            queue.note(index)

    @property
    def has_error(self) -> bool:
        """An error waits to be raised (after the pending output, if any)."""
        return self._error is not None

    def get_nowait(self) -> RequestOutput | None:
        """The pending output (None if there is none); raises the error once drained."""
        output = self._output
        if output is not None and (self._ready.is_set() or output.finished):
            self._output = None
            self._pending_tokens = 0
            self.unread_units = 0
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


class ReadyQueue:
    """Which prompts of a parent request (``request_stream.ParentRequest``, reading several
    collectors in one task) have news for its reader, in the order the news came. Collectors
    note their prompt here as the output handler fills them: a call down into this module,
    never back up into the parent request."""

    __slots__ = ("_order", "_queued", "woken")

    def __init__(self) -> None:
        self._order: deque[int] = deque()  # prompt indexes
        self._queued: set[int] = set()  # those in ``_order``
        self.woken = trio.Event()  # set when a prompt joins the queue

    def note(self, index: int) -> None:
        if index not in self._queued:
            self._queued.add(index)
            self._order.append(index)
            self.woken.set()

    def pop(self) -> int | None:
        """The prompt with the oldest news (None when none has any)."""
        if not self._order:
            return None
        index = self._order.popleft()
        self._queued.discard(index)
        return index

    def __bool__(self) -> bool:
        return bool(self._order)

    def rearm(self) -> None:
        """A fresh ``woken`` before the reader scans: news arriving after it sets this one."""
        self.woken = trio.Event()
