"""Stage 11's one SSE driver: the event stream of a chat or completion request.

``sse_stream`` owns what both APIs share: one write per engine output (every choice's events
of that output), the last output of a single-prompt request held back and written with the
end events, an ``abort`` end event for each choice the server cut short, the usage chunk,
``[DONE]``, an error event when the generation fails after the stream started, and the
clean-up. What the events say is the ``Chunks`` it is handed (``completion_output.py``,
``chat_output.py``): the driver calls down into them and never back into the endpoint.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

import orjson

from trillm.entrypoints.openai.endpoints.generation import Generation, raise_if_error
from trillm.entrypoints.openai.endpoints.usage import RequestTracker
from trillm.entrypoints.openai.http.errors import APIError, sse_error_event
from trillm.outputs import CompletionOutput, PromptLogprobs

DONE = b"data: [DONE]\n\n"


class Chunks(Protocol):
    """The chunks of one request's stream, spelled for its API."""

    head: bytes  # every chunk's prefix: 'data: {"id":..,"object":..,"created":..,"model":..,"choices":['

    def num_choices(self) -> int: ...

    def single_job(self) -> bool:
        """One prompt: its last output is written together with the end events."""
        ...

    def opening(self) -> tuple[bytes, list[bytes]]:
        """(written at once, written with the first output)."""
        ...

    def add_events(
        self,
        parts: list[bytes],
        job: int,
        c: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> int:
        """Append the events of choice ``c`` of prompt ``job`` (``prompt_logprobs``: the
        prompt's, on the output that carries them); -> the choice's index."""
        ...

    def abort_event(self, index: int) -> bytes: ...


async def sse_stream(
    gen: Generation, chunks: Chunks, tracker: RequestTracker, include_usage: bool
) -> AsyncIterator[bytes]:
    """``gen``'s outputs as SSE writes; ``include_usage``: ``stream_options.include_usage``."""
    num = chunks.num_choices()
    finished: set[int] = set()
    now, parts = chunks.opening()
    try:
        if now:
            yield now
        async for job, item in gen:
            out = raise_if_error(item)
            tracker.observe(out, job)
            for c in out.outputs:
                index = chunks.add_events(parts, job, c, out.prompt_logprobs)
                if c.finish_reason is not None:
                    finished.add(index)
            if out.finished and chunks.single_job():
                continue  # the generation ends here: written with the end events below
            if parts:
                yield b"".join(parts)
                parts = []
        # The channel closed before every choice finished: the server aborted them.
        parts.extend(chunks.abort_event(i) for i in range(num) if i not in finished)
        if include_usage:
            usage = orjson.dumps(tracker.usage())
            parts.append(chunks.head + b'],"usage":' + usage + b"}\n\n")
        parts.append(DONE)
        yield b"".join(parts)
    except APIError as err:
        yield b"".join(parts) + sse_error_event(err) + DONE
    finally:
        await gen.aclose()
        tracker.finish(num)
