"""Stage 10: the output processor's per-request state, and the ``RequestOutput``s built from it.

One user request is an ``OutputGroup`` of ``n`` ``OutputSample``s (engine requests) sharing one
collector. ``make_output`` turns what a sample holds and has not yet sent (text short of the
stop-string hold-back, tokens, logprob rows, the group's prompt logprobs) into the output a
``RequestOutputKind`` asks for, and marks it sent. The records are owned by the output
processor (``output_processor.py``), which alone creates, updates and drops them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from trillm.engine.detokenizer import Detokenizer
from trillm.engine.logprobs import SampleLogprobsBuilder
from trillm.engine.output_collector import RequestOutputCollector
from trillm.engine.stop_strings import StopStringMatcher
from trillm.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from trillm.sampling_params import RequestOutputKind, SamplingParams


@dataclass(slots=True, eq=False)
class OutputGroup:
    """One user request: ``n`` samples sharing a collector."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    output_kind: RequestOutputKind
    collector: RequestOutputCollector
    metrics: RequestMetrics
    engine_ids: list[str]
    unfinished: set[str]
    num_prompt_logprobs: int | None
    prompt_logprobs: PromptLogprobs | None = None  # [None] + one dict per prompt position
    sent_prompt_logprobs: int = 0
    num_cached_tokens: int = 0
    num_cache_creation_tokens: int = 0
    final_completions: list[CompletionOutput] = field(default_factory=list)  # FINAL_ONLY
    slot: int = 0  # wake-budget round-robin slot
    started: bool = False  # an output went to the collector
    pooled: bytes | None = None  # a pooling model's vector


@dataclass(slots=True, eq=False)
class OutputSample:
    """One engine request (one sample of a group)."""

    engine_id: str
    index: int
    group: OutputGroup
    params: SamplingParams
    detokenizer: Detokenizer | None
    stop: StopStringMatcher | None
    logprobs: SampleLogprobsBuilder | None
    token_ids: list[int] = field(default_factory=list)
    text: str = ""  # final text, truncated at a matched stop string
    sent_text: int = 0  # characters / tokens / logprob rows already handed to the collector
    sent_tokens: int = 0
    sent_logprobs: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # --collect-detailed-traces: (forward s, execute s) so far (EngineCoreOutput.model_times)
    model_times: tuple[float | None, float | None] | None = None


def make_output(sample: OutputSample, finished: bool) -> RequestOutput | None:
    """The group's output for what ``sample`` has not sent yet (None: nothing to send)."""
    group = sample.group
    if group.output_kind == RequestOutputKind.FINAL_ONLY:
        if sample.finish_reason is not None:
            group.final_completions.append(_completion(sample, delta=False))
        if not finished:
            return None
        completions = sorted(group.final_completions, key=lambda c: c.index)
        return _request_output(group, completions, finished, delta=False)
    delta = group.output_kind == RequestOutputKind.DELTA
    has_news = (
        sample.finish_reason is not None
        or sample.sent_tokens < len(sample.token_ids)
        or _new_prompt_logprobs(group)
    )
    if not has_news:
        return None
    return _request_output(group, [_completion(sample, delta)], finished, delta)


def _request_output(
    group: OutputGroup, completions: list[CompletionOutput], finished: bool, delta: bool
) -> RequestOutput:
    return RequestOutput(
        request_id=group.request_id,
        prompt=group.prompt,
        prompt_token_ids=group.prompt_token_ids,
        prompt_logprobs=_take_prompt_logprobs(group, delta),
        outputs=completions,
        finished=finished,
        num_cached_tokens=group.num_cached_tokens,
        num_cache_creation_tokens=group.num_cache_creation_tokens,
        metrics=_copy_metrics(group.metrics),
        pooled=group.pooled,
    )


def _completion(sample: OutputSample, delta: bool) -> CompletionOutput:
    end = _visible_text_end(sample)
    lp = sample.logprobs
    if delta:
        text = sample.text[sample.sent_text : end]
        token_ids = sample.token_ids[sample.sent_tokens :]
        logprobs = lp.rows[sample.sent_logprobs :] if lp is not None else None
    else:
        text = sample.text[:end]
        token_ids = list(sample.token_ids)
        logprobs = list(lp.rows) if lp is not None else None
    sample.sent_text = end
    sample.sent_tokens = len(sample.token_ids)
    sample.sent_logprobs = len(lp.rows) if lp is not None else 0
    out = CompletionOutput(
        index=sample.index,
        text=text,
        token_ids=token_ids,
        cumulative_logprob=lp.cumulative if lp is not None else None,
        logprobs=logprobs,
        finish_reason=sample.finish_reason,
        stop_reason=sample.stop_reason,
    )
    if sample.model_times is not None and sample.finish_reason is not None:
        out.model_forward_time, out.model_execute_time = sample.model_times
    return out


def _visible_text_end(sample: OutputSample) -> int:
    """How much of the text may be sent: all of it once finished, else all but the
    stop-string hold-back (never less than what was already sent)."""
    if sample.finish_reason is not None or sample.stop is None:
        return len(sample.text)
    return max(sample.sent_text, len(sample.text) - sample.stop.hold_back)


def _new_prompt_logprobs(group: OutputGroup) -> bool:
    rows = group.prompt_logprobs
    return rows is not None and len(rows) > 1 and group.sent_prompt_logprobs < len(rows)


def _take_prompt_logprobs(group: OutputGroup, delta: bool) -> PromptLogprobs | None:
    rows = group.prompt_logprobs
    if rows is None:
        return None
    start = group.sent_prompt_logprobs
    group.sent_prompt_logprobs = len(rows)
    if delta:
        return rows[start:] if start < len(rows) else None
    return list(rows)


def _copy_metrics(m: RequestMetrics) -> RequestMetrics:
    return RequestMetrics(
        m.arrival_time,
        m.first_token_time,
        m.last_token_time,
        m.finished_time,
        m.num_generation_tokens,
        m.first_scheduled_time,
        m.engine_index,
    )
