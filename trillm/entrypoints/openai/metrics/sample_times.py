"""One engine request's figures when it ends, as /metrics observes them and a trace span
carries them (``tracing.py``): computed once here so the two never disagree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import attrs

if TYPE_CHECKING:
    from trillm.outputs import RequestOutput


class SampleProgress(Protocol):
    """What a request's sample (``requests.Sample``) has seen of its tokens."""

    prompt_len: int
    first: float | None  # time.perf_counter of its first token
    last: float | None  # ... and of its latest
    count: int


@attrs.frozen
class SampleTimes:
    """Seconds and token counts of one finished engine request (None: it has no such phase,
    or the engine did not report the time)."""

    prompt_tokens: int
    completion_tokens: int
    e2e: float  # from the HTTP request's start to the sample's end (frontend clock)
    ttft: float | None  # to its first token (frontend clock)
    decode: float | None  # its first token to its last (frontend clock)
    queue: float | None  # arrival to first scheduled (engine clock)
    prefill: float | None  # first scheduled to first token (engine clock)
    inference: float | None  # first scheduled to last token (engine clock)


def sample_times(
    start: float, now: float, s: SampleProgress, out: RequestOutput | None
) -> SampleTimes:
    """``s`` ended at ``now`` (``time.perf_counter``) in a request started at ``start``;
    ``out``: its last RequestOutput, whose ``metrics`` carry the engine's times (None: it
    never produced one)."""
    ttft = decode = queue = prefill = inference = None
    if s.first is not None and s.last is not None:
        ttft = s.first - start
        decode = s.last - s.first
    times = out.metrics if out is not None else None
    scheduled = times.first_scheduled_time if times is not None else None
    if scheduled is not None and times is not None:
        queue = max(scheduled - times.arrival_time, 0.0)
        if times.first_token_time is not None:
            prefill = max(times.first_token_time - scheduled, 0.0)
        if times.last_token_time is not None:
            inference = max(times.last_token_time - scheduled, 0.0)
    return SampleTimes(s.prompt_len, s.count, now - start, ttft, decode, queue, prefill, inference)
