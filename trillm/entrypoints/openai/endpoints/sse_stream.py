"""Stage 11's one SSE driver: the event stream of a chat or completion request.

``SSEStream.stream`` owns what both APIs share: the chunk prefix (id, object, created, model),
one write per engine output (every choice's events of that output), the last output of a
single-prompt request held back and written with the end events, an ``abort`` end event for
each choice the server cut short, the usage chunk, ``[DONE]``, an error event when the
generation fails after the stream started, and the clean-up. A subclass says what its events
are: what opens the stream, each choice's events for an output, and an aborted choice's end.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson

from trillm.entrypoints.openai.endpoints.base import RequestTracker, raise_if_error
from trillm.entrypoints.openai.endpoints.generation import Generation
from trillm.entrypoints.openai.http.errors import APIError, sse_error_event

DONE = b"data: [DONE]\n\n"


class SSEStream:
    OBJECT: bytes = b""  # the chunks' "object"
    request_id: str
    created: int
    model_name: str
    req: Any
    tracker: RequestTracker
    head: bytes  # 'data: {"id":..,"object":..,"created":..,"model":..,"choices":['

    # ------------------------------------------------------------ what a subclass says
    def num_choices(self) -> int:
        raise NotImplementedError

    def single_job(self) -> bool:
        """One prompt: its last output is written together with the end events."""
        return True

    def opening(self) -> tuple[bytes, list[bytes]]:
        """(written at once, written with the first output)."""
        return b"", []

    def add_events(self, parts: list[bytes], job: int, c: Any) -> int:
        """Append the events of choice ``c`` of prompt ``job``; -> the choice's index."""
        raise NotImplementedError

    def abort_event(self, index: int) -> bytes:
        raise NotImplementedError

    # ------------------------------------------------------------ the stream
    async def stream(self, gen: Generation) -> AsyncIterator[bytes]:
        self.head = (
            b'data: {"id":'
            + orjson.dumps(self.request_id)
            + b',"object":"'
            + self.OBJECT
            + b'","created":'
            + str(self.created).encode()
            + b',"model":'
            + orjson.dumps(self.model_name)
            + b',"choices":['
        )
        num = self.num_choices()
        finished: set[int] = set()
        now, parts = self.opening()
        try:
            if now:
                yield now
            async for job, item in gen:
                out = raise_if_error(item)
                self.tracker.observe(out, job)
                for c in out.outputs:
                    index = self.add_events(parts, job, c)
                    if c.finish_reason is not None:
                        finished.add(index)
                if out.finished and self.single_job():
                    continue  # the generation ends here: written with the end events below
                if parts:
                    yield b"".join(parts)
                    parts = []
            # The channel closed before every choice finished: the server aborted them.
            parts.extend(self.abort_event(i) for i in range(num) if i not in finished)
            if self.req.stream_options is not None and self.req.stream_options.include_usage:
                usage = orjson.dumps(self.tracker.usage())
                parts.append(self.head + b'],"usage":' + usage + b"}\n\n")
            parts.append(DONE)
            yield b"".join(parts)
        except APIError as err:
            yield b"".join(parts) + sse_error_event(err) + DONE
        finally:
            await gen.aclose()
            self.tracker.finish(num)
