"""Stage 10: EngineCoreOutputs -> detokenized, stop-checked ``RequestOutput``s -> collectors.

Runs inside the frontend's output-handler Trio task; everything here is synchronous and owned
by that task. One user request is a *group* of ``n`` samples (engine requests, the "children"
when n > 1) that share one ``RequestOutputCollector``; every output names the group's id and
carries ``CompletionOutput``s indexed by sample.

Per sample: the incremental detokenizer turns token ids into final text; stop strings are
matched on that text across token boundaries, with a hold-back so a partial stop string is
never sent and then retracted. A stop-string finish is only known here, so
``process_outputs`` returns those engine ids for the caller to abort in the engine core.

Outputs go to each group's ``RequestOutputCollector`` (``output_collector.py``), which never
makes the handler wait on a slow reader. A stream whose reader leaves more than
``MAX_UNREAD_UNITS`` unread (a client that stopped reading) is aborted at the end of the step,
with one warning: its reader gets what it left unread, then the final 'abort' output.

Pieces by responsibility: the per-request records and the outputs built from them
(``output_state.py``), stop strings (``stop_strings.py``), logprobs formatted once with their
token texts (``logprobs.py``), stream pacing, the wake budget (``stream_pacing.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from trillm.engine.detokenizer import DetokenizerFactory
from trillm.engine.logprobs import SampleLogprobsBuilder, TokenTexts, make_logprob_dict, slice_lists
from trillm.engine.output_collector import MAX_UNREAD_UNITS, RequestOutputCollector
from trillm.engine.output_state import OutputGroup, OutputSample, make_output
from trillm.engine.preprocess import InvalidRequestError
from trillm.engine.skipped_tokenizer import SkippedTokenizer
from trillm.engine.stop_strings import StopStringMatcher
from trillm.engine.stream_pacing import DEFAULT_WAKE_BUDGET, StreamPacing
from trillm.messages import EngineCoreOutput, FinishReason, LogprobsLists
from trillm.outputs import RequestMetrics, RequestOutput
from trillm.sampling_params import RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)


class OutputProcessor:
    """Owns the output side of every in-flight request (see the module docstring)."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        native: bool | None = None,
        stream_interval: int = 1,
        wake_budget: int | None = DEFAULT_WAKE_BUDGET,
    ) -> None:
        if stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {stream_interval}.")
        self.stream_interval = stream_interval
        self._pacing: StreamPacing[OutputSample] = StreamPacing(wake_budget)
        self.tokenizer = tokenizer
        # None: --skip-tokenizer-init, no detokenization (the outputs' text stays empty)
        self._detokenizers = (
            None
            if isinstance(tokenizer, SkippedTokenizer)
            else DetokenizerFactory(tokenizer, native=native)
        )
        self._groups: dict[str, OutputGroup] = {}  # request id -> group
        self._samples: dict[str, OutputSample] = {}  # engine request id -> sample
        # token id -> decode([id]): the logprob entries' texts (the HTTP layer's too)
        self.token_texts = TokenTexts(tokenizer)
        self._unread: list[OutputGroup] = []  # groups whose reader left too much unread this step

    # ------------------------------------------------------------ registration
    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
        child_ids: Sequence[str] | None = None,
        *,
        queue: RequestOutputCollector | None = None,
        arrival_time: float | None = None,
    ) -> RequestOutputCollector:
        """Register a request; ``child_ids`` are its engine request ids, one per sample
        (default: ``[request_id]``). Returns the collector its outputs go to (``queue``
        when given)."""
        engine_ids = list(child_ids) if child_ids is not None else [request_id]
        if request_id in self._groups or any(e in self._samples for e in engine_ids):
            raise InvalidRequestError(
                f"Request id {request_id!r} is already in flight.", "request_id"
            )
        collector = (
            queue
            if queue is not None
            else RequestOutputCollector(params.output_kind, self.stream_interval)
        )
        group = OutputGroup(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            output_kind=params.output_kind,
            collector=collector,
            metrics=RequestMetrics(arrival_time if arrival_time is not None else time.time()),
            engine_ids=engine_ids,
            unfinished=set(engine_ids),
            num_prompt_logprobs=params.prompt_logprobs,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
        )
        if params.output_kind != RequestOutputKind.FINAL_ONLY:
            group.slot = self._pacing.add_stream()
        self._groups[request_id] = group
        for index, engine_id in enumerate(engine_ids):
            self._samples[engine_id] = self._new_sample(engine_id, index, group, params)
        return collector

    def _new_sample(
        self, engine_id: str, index: int, group: OutputGroup, params: SamplingParams
    ) -> OutputSample:
        detokenizer = None
        stop = None
        if params.detokenize and self._detokenizers is not None:
            detokenizer = self._detokenizers.new(
                params.skip_special_tokens,
                group.prompt_token_ids,
                params.spaces_between_special_tokens,
            )
            if params.stop:
                stop = StopStringMatcher(params.stop, params.include_stop_str_in_output)
        logprobs = SampleLogprobsBuilder(params.logprobs) if params.logprobs is not None else None
        return OutputSample(engine_id, index, group, params, detokenizer, stop, logprobs)

    def assign_engine(self, request_id: str, engine_index: int) -> None:
        """The engine core the router gave the request: its outputs' ``metrics`` say so (the
        request series of /metrics are per engine core)."""
        self._groups[request_id].metrics.engine_index = engine_index

    def child_ids(self, request_id: str) -> list[str]:
        group = self._groups.get(request_id)
        return list(group.engine_ids) if group is not None else []

    def has_unfinished_requests(self) -> bool:
        return bool(self._groups)

    def num_unfinished_requests(self) -> int:
        return len(self._groups)

    # ------------------------------------------------------------ engine outputs
    def process_outputs(
        self,
        outputs: Sequence[EngineCoreOutput],
        timestamp: float | None = None,
        model_time_s: float = 0.0,
    ) -> list[str]:
        """Deliver one step's outputs; returns engine ids finished here by a stop string,
        which the caller must abort in the engine core. ``model_time_s``: the step's time in
        the model (it sizes the wake budget)."""
        now = timestamp if timestamp is not None else time.time()
        to_abort: list[str] = []
        self._pacing.begin_step(model_time_s)
        for out in outputs:
            sample = self._samples.get(out.request_id)
            if sample is None:
                continue  # aborted while this step was in flight
            try:
                self._record_prompt_side(sample, out, now)
                stop_string = self._update_sample(sample, out)
            except Exception:  # NOTE: one request's output, never the handler (and engine)
                logger.exception("output of request %s could not be processed", out.request_id)
                stop_string = None
                if not out.finished:
                    to_abort.append(out.request_id)
                out = replace(out, finish_reason=FinishReason.ABORT)
            if stop_string is not None:
                self._finish(sample, "stop", stop_string)
                if not out.finished:
                    to_abort.append(out.request_id)
            elif out.finish_reason is not None:
                self._finish(sample, str(out.finish_reason), out.stop_reason)
            self._deliver(sample, now)
        self._release_stalled()
        if self._unread:
            to_abort.extend(self._abort_unread())
        return to_abort

    def _release_stalled(self) -> None:
        """Held samples that got no output this step (preempted, waiting) send what they hold."""
        for sample in self._pacing.take_stalled():
            output = make_output(sample, finished=False)
            if output is not None:
                self._put(sample.group, output)

    def _record_prompt_side(self, sample: OutputSample, out: EngineCoreOutput, now: float) -> None:
        group = sample.group
        group.num_cached_tokens = max(group.num_cached_tokens, out.num_cached_tokens)
        group.num_cache_creation_tokens = max(
            group.num_cache_creation_tokens, out.num_cache_creation_tokens
        )
        if out.scheduled_time is not None and group.metrics.first_scheduled_time is None:
            group.metrics.first_scheduled_time = out.scheduled_time
        if out.model_times is not None:  # --collect-detailed-traces
            sample.model_times = out.model_times
        if out.pooled is not None:
            group.pooled = out.pooled
        if out.new_token_ids:
            if group.metrics.first_token_time is None:
                group.metrics.first_token_time = now
            group.metrics.last_token_time = now
        # NOTE: the samples of a group share the prompt; sample 0's prompt logprobs stand for all.
        if out.new_prompt_logprobs is not None and sample.index == 0:
            if group.prompt_logprobs is not None and group.num_prompt_logprobs is not None:
                lists = out.new_prompt_logprobs
                k = group.num_prompt_logprobs
                for ids, lps, rank in zip(lists.token_ids, lists.logprobs, lists.ranks):
                    row = make_logprob_dict(ids, lps, rank, k, self.token_texts)
                    group.prompt_logprobs.append(row)

    def _update_sample(self, sample: OutputSample, out: EngineCoreOutput) -> str | None:
        """Append the new tokens (and their text and logprobs); the stop string that ended
        the sample, if any. Tokens after a stop string are dropped."""
        ids = out.new_token_ids
        detok = sample.detokenizer
        if detok is None:
            self._append_tokens(sample, ids, out.new_logprobs)
            return None
        # NOTE: as vLLM, the EOS / stop token that ended the sample has no text (it would
        # show with skip_special_tokens false, or for a plain stop_token_ids entry).
        silent = (
            ids
            and out.finish_reason == FinishReason.STOP
            and not isinstance(out.stop_reason, str)
            and not sample.params.include_stop_str_in_output
        )
        text_ids = ids[:-1] if silent else ids
        # With stop strings, feed one token at a time so a match drops the tokens after it.
        many = sample.stop is not None and len(text_ids) > 1
        pieces = [text_ids[i : i + 1] for i in range(len(text_ids))] if many else [text_ids]
        pieces = pieces or [[]]  # a finish without new tokens still flushes
        for i, piece in enumerate(pieces):
            new_text = detok.add_tokens(piece)
            if out.finished and i == len(pieces) - 1:
                new_text += detok.flush()
            new_from = len(sample.text)
            sample.text += new_text
            self._append_tokens(sample, piece, out.new_logprobs, offset=i if many else 0)
            stop_string = self._check_stop(sample, out, new_from)
            if stop_string is not None:
                return stop_string
        if silent:
            self._append_tokens(sample, ids[-1:], out.new_logprobs, offset=len(ids) - 1)
        return None

    def _check_stop(self, sample: OutputSample, out: EngineCoreOutput, new_from: int) -> str | None:
        if sample.stop is None or out.finish_reason == FinishReason.ABORT:
            return None
        if len(sample.token_ids) <= sample.params.min_tokens:
            return None  # as in vLLM, text of the first min_tokens tokens is not searched
        match = sample.stop.find(sample.text, new_from)
        if match is None:
            return None
        stop_string, cut = match
        sample.text = sample.text[:cut]
        return stop_string

    def _append_tokens(
        self,
        sample: OutputSample,
        ids: Sequence[int],
        lists: LogprobsLists | None,
        offset: int = 0,
    ) -> None:
        sample.token_ids.extend(ids)
        sample.group.metrics.num_generation_tokens += len(ids)
        if sample.logprobs is not None and lists is not None and ids:
            window = slice_lists(lists, offset, offset + len(ids))
            sample.logprobs.add(window, len(ids), self.token_texts)

    def _finish(self, sample: OutputSample, reason: str, stop_reason: int | str | None) -> None:
        sample.finish_reason = reason
        sample.stop_reason = stop_reason
        sample.group.unfinished.discard(sample.engine_id)
        del self._samples[sample.engine_id]

    # ------------------------------------------------------------ outputs
    def _deliver(self, sample: OutputSample, now: float) -> None:
        group = sample.group
        finished = not group.unfinished
        if finished:
            group.metrics.finished_time = now
            if self._groups.pop(group.request_id, None) is not None:
                if group.output_kind != RequestOutputKind.FINAL_ONLY:
                    self._pacing.remove_stream()
        elif (
            group.started
            and sample.finish_reason is None
            and group.output_kind != RequestOutputKind.FINAL_ONLY
            and self._pacing.holds(group.slot)
        ):
            # Not this stream's slot: its news stay unsent (the sample's sent_* marks) and go
            # out, merged, in its next slot. Nothing is built for it now.
            self._pacing.hold(sample.engine_id, sample)
            return
        self._pacing.release(sample.engine_id)
        output = make_output(sample, finished)
        if output is not None:
            group.started = True
            self._put(group, output)

    def _put(self, group: OutputGroup, output: RequestOutput) -> None:
        if group.collector.put(output):
            self._unread.append(group)

    def _abort_unread(self) -> list[str]:
        """End the requests whose readers stopped reading; their engine ids, to abort."""
        engine_ids: list[str] = []
        for group in self._unread:
            if group.request_id not in self._groups:
                continue  # finished in the same step
            logger.warning(
                "Request %s: its client left more than %d units of output unread (it stopped "
                "reading its stream); aborting the request.",
                group.request_id,
                MAX_UNREAD_UNITS,
            )
            engine_ids.extend(group.unfinished)
            self.abort_request(group.request_id)
        self._unread.clear()
        return engine_ids

    # ------------------------------------------------------------ aborts and failures
    def abort_request(
        self, request_id: str, collector: RequestOutputCollector | None = None
    ) -> bool:
        """Drop a request (its reader left or asked to cancel). Returns True if some of its
        samples were still running, i.e. the engine core must be told to abort them. The
        collector gets a final 'abort' output so a waiting reader wakes up. ``collector``:
        only the request reading into it (a late abort must not end a newer request that
        reuses the id)."""
        group = self._groups.get(request_id)
        if group is None or (collector is not None and group.collector is not collector):
            return False
        now = time.time()
        for engine_id in list(group.unfinished):
            sample = self._samples[engine_id]
            if sample.detokenizer is not None:
                sample.text += sample.detokenizer.flush()
            self._finish(sample, str(FinishReason.ABORT), None)
            self._deliver(sample, now)
        return True

    def fail_all(self, error: BaseException) -> None:
        """The engine is gone: every in-flight request's reader gets ``error``."""
        for group in self._groups.values():
            group.collector.put_error(error)
        self._groups.clear()
        self._samples.clear()
        self._pacing.clear()
