"""Beam search on the engine, as vLLM runs it: above the engine, one token per beam per step.

Each step, every running beam of every unfinished prompt is one engine request of one greedy
token asking for the top ``K`` logprobs (``beam_search.candidates_per_beam``); prefix caching
shares the beams' common prefix, and the requests go through the normal scheduler, so a beam
search takes its turn beside other requests instead of holding the batch. What each step's
logprobs decide is ``beam_search.PromptSearch`` (transformers' rules).

``BeamSearchRequest`` reads like a ``ParentRequest`` (``async with`` it, then ``async for
index, out``), so the HTTP layer's admission, answers and SSE driver take it unchanged: a
prompt's item is one final ``RequestOutput`` whose ``W`` outputs are its beams, best first.
The search runs in the reader's task, at its first read; each step is one
``generate_many`` block, so a cancellation (a client gone) aborts every beam of the step.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING

import trio

from trillm.engine.beam_search import Beam, End, EndRule, Hypothesis, PromptSearch
from trillm.engine.beam_search import candidates_per_beam as candidates_per_beam
from trillm.engine.preprocess import InvalidRequestError, PreparedPrompt
from trillm.engine.prompt_embeds import inputs_field
from trillm.lora.request import LoRARequest
from trillm.outputs import (
    BeamSearchOutput,
    BeamSearchSequence,
    CompletionOutput,
    RequestOutput,
)
from trillm.sampling_extras import logprob_cap
from trillm.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from trillm.engine.async_engine import AsyncEngine


@dataclass(slots=True)
class _PromptRun:
    index: int
    prompt: PreparedPrompt
    search: PromptSearch
    interrupted: str | None = None  # the finish_reason of a step that ended it early
    error: Exception | None = None
    beams: list[Beam] = field(default_factory=list)  # this step's running beams

    @property
    def over(self) -> bool:
        return self.search.done or self.interrupted is not None or self.error is not None


class BeamSearchRequest:
    """Prompts searched together; items are ``(prompt index, RequestOutput | Exception)``,
    in prompt order once the search is over (a prompt's failure is its item alone)."""

    def __init__(
        self,
        engine: AsyncEngine,
        prompts: Sequence[PreparedPrompt],
        params: BeamSearchParams,
        request_ids: Sequence[str],
        *,
        lora_requests: Sequence[LoRARequest | None] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 - the whole search's deadline
        max_in_flight: int | None = None,
        may_start: Callable[[], bool] | None = None,
        keep_logprobs: bool = False,  # each beam's per-token candidates (LLM.beam_search's)
    ) -> None:
        pre = engine.preprocessor
        self.eos_ids = frozenset(t for t in (pre.eos_token_id, *pre.extra_eos_ids) if t is not None)
        # EOS ids widen the candidates (ending ones must not crowd out the W that run on).
        self.num_eos = 0 if params.ignore_eos else len(self.eos_ids)
        self.k = candidates_per_beam(params.beam_width, self.num_eos)
        _check_request(prompts, params, self.k, logprob_cap(pre.max_logprobs, pre.vocab_size))
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.params = params
        self.request_ids = list(request_ids)
        self.loras = list(lora_requests) if lora_requests else [None] * len(prompts)
        self.deadline = math.inf if timeout is None else trio.current_time() + timeout
        self.max_in_flight = max_in_flight
        self.may_start = may_start
        self.keep_logprobs = keep_logprobs
        self.step_params = SamplingParams(
            max_tokens=1,
            temperature=0.0,
            logprobs=self.k,
            ignore_eos=True,  # a beam's end is decided here, from the candidates
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        ends = self._end_rule()
        self.runs = [
            _PromptRun(i, p, PromptSearch(_own(params, p), self.num_eos, ends, keep_logprobs))
            for i, p in enumerate(prompts)
        ]
        self._items: list[tuple[int, RequestOutput | Exception]] | None = None

    # ------------------------------------------------------------------ reading
    async def __aenter__(self) -> BeamSearchRequest:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        return None  # each step's requests are aborted by the step's own block

    def __aiter__(self) -> BeamSearchRequest:
        return self

    async def __anext__(self) -> tuple[int, RequestOutput | Exception]:
        if self._items is None:
            await self.run()
            self._items = [(run.index, self._request_output(run)) for run in self.runs]
        if not self._items:
            raise StopAsyncIteration
        return self._items.pop(0)

    async def run(self, on_step: Callable[[], None] | None = None) -> None:
        """Step every unfinished prompt's beams until all are over (``on_step`` after each)."""
        step = 0
        while live := [run for run in self.runs if not run.over]:
            await self._step(live, step)
            step += 1
            if on_step is not None:
                on_step()

    def outputs(self) -> list[BeamSearchOutput]:
        """``LLM.beam_search``'s result (after ``run``): per prompt its beams, best first;
        the first prompt that failed raises."""
        for run in self.runs:
            if run.error is not None:
                raise run.error
        return [
            BeamSearchOutput([self._sequence(run, h) for h in self._best(run)]) for run in self.runs
        ]

    # ------------------------------------------------------------------ one step
    async def _step(self, live: list[_PromptRun], step: int) -> None:
        """1) each live prompt's running beams as one-token requests, 2) read them all,
        3) advance each prompt with its beams' candidates (or end it early)."""
        jobs: list[PreparedPrompt] = []
        owners: list[_PromptRun] = []
        for run in live:
            run.beams = list(run.search.running)
            for beam in run.beams:
                jobs.append(self._job(run.prompt, beam))
                owners.append(run)
        ids = [f"{self.request_ids[run.index]}-beam{step}-{j}" for j, run in enumerate(owners)]
        results = await self._read(jobs, ids, [self.loras[run.index] for run in owners])
        start = 0
        for run in live:
            mine = results[start : start + len(run.beams)]
            start += len(run.beams)
            self._advance(run, mine)

    def _job(self, prompt: PreparedPrompt, beam: Beam) -> PreparedPrompt:
        ids = prompt.prompt_token_ids + beam.tokens
        return PreparedPrompt(
            ids, self.step_params, priority=prompt.priority, cache_salt=prompt.cache_salt
        )

    async def _read(
        self, jobs: list[PreparedPrompt], ids: list[str], loras: list[LoRARequest | None]
    ) -> list[RequestOutput | Exception | None]:
        results: list[RequestOutput | Exception | None] = [None] * len(jobs)
        left = self.deadline - trio.current_time()
        request = self.engine.generate_many(
            jobs,
            None,
            ids,
            timeout=None if left == math.inf else max(left, 1e-3),
            lora_requests=loras,
            max_in_flight=self.max_in_flight,
            may_start=self.may_start,
        )
        async with request as items:
            async for index, out in items:
                if isinstance(out, Exception) or out.finished:
                    results[index] = out
        return results

    def _advance(self, run: _PromptRun, results: list[RequestOutput | Exception | None]) -> None:
        candidates = []
        for out in results:
            if isinstance(out, Exception):
                run.error = out
                return
            sample = out.outputs[0] if out is not None and out.outputs else None
            if sample is None or not sample.logprobs or sample.finish_reason != "length":
                run.interrupted = (sample.finish_reason if sample else None) or "abort"
                return
            candidates.append(sample.logprobs[0])
        run.search.advance(candidates)

    # ------------------------------------------------------------------ ends and texts
    def _end_rule(self) -> EndRule:
        eos = frozenset() if self.params.ignore_eos else self.eos_ids
        stops = self.params.stop or []

        def ends(tokens: list[int]) -> End | None:
            if tokens[-1] in eos:
                return ("stop", tokens[-1])
            if stops:
                text = self._decode(tokens)
                for stop in stops:
                    if stop in text:
                        return ("stop", stop)
            return None

        return ends

    def _decode(self, tokens: list[int]) -> str:
        skip = self.params.skip_special_tokens
        return self.tokenizer.decode(tokens, skip_special_tokens=skip)

    def output_text(self, beam: Beam) -> str:
        """The beam's text: its EOS or stop string left out unless
        ``include_stop_str_in_output``."""
        keep = self.params.include_stop_str_in_output
        reason = beam.stop_reason
        tokens = beam.tokens
        if isinstance(reason, int) and not keep:
            tokens = tokens[:-1]
        text = self._decode(tokens)
        if isinstance(reason, str):
            at = text.find(reason)
            text = text[: at + len(reason)] if keep else text[:at]
        return text

    def _best(self, run: _PromptRun) -> list[Hypothesis]:
        best = run.search.best()
        for h in best:
            if h.beam.finish_reason is None:  # running when the search was interrupted
                h.beam.finish_reason = run.interrupted or "length"
        return best

    def _request_output(self, run: _PromptRun) -> RequestOutput | Exception:
        if run.error is not None:
            return run.error
        outputs = [
            CompletionOutput(
                index=i,
                text=self.output_text(h.beam),
                token_ids=h.beam.tokens,
                cumulative_logprob=h.beam.cum_logprob,
                logprobs=h.beam.logprobs if self.keep_logprobs else None,
                finish_reason=h.beam.finish_reason,
                stop_reason=h.beam.stop_reason,
            )
            for i, h in enumerate(self._best(run))
        ]
        return RequestOutput(
            request_id=self.request_ids[run.index],
            prompt=run.prompt.text,
            prompt_token_ids=run.prompt.prompt_token_ids,
            prompt_logprobs=None,
            outputs=outputs,
            finished=True,
        )

    def _sequence(self, run: _PromptRun, h: Hypothesis) -> BeamSearchSequence:
        prompt_ids = run.prompt.prompt_token_ids
        prompt_text = run.prompt.text
        if prompt_text is None:
            prompt_text = self.tokenizer.decode(prompt_ids)
        return BeamSearchSequence(
            tokens=prompt_ids + h.beam.tokens,
            logprobs=h.beam.logprobs,
            cum_logprob=h.beam.cum_logprob,
            text=prompt_text + self.output_text(h.beam),
            finish_reason=h.beam.finish_reason,
            stop_reason=h.beam.stop_reason,
        )


def _own(params: BeamSearchParams, prompt: PreparedPrompt) -> BeamSearchParams:
    """A prompt's params: its ``max_tokens`` as its preparation resolved it, when smaller
    (HTTP: the room its context leaves)."""
    limit = prompt.params.max_tokens
    if limit is None or limit >= params.max_tokens:
        return params
    return dataclasses.replace(params, max_tokens=limit)


def _check_request(
    prompts: Sequence[PreparedPrompt], params: BeamSearchParams, k: int, max_logprobs: int
) -> None:
    """What beam search cannot serve, refused before any work, naming it."""
    if k > max_logprobs:
        raise InvalidRequestError(
            f"Beam search with beam width {params.beam_width} ranks {k} candidates per beam "
            f"each step, more than the server's max_logprobs ({max_logprobs}); lower the "
            "beam width (n) or raise --max-logprobs.",
            "n",
        )
    for p in prompts:
        if p.mm_items:  # (vLLM refuses prompt embeddings too)
            given = inputs_field(p.mm_items)
            what = "images (multi_modal_data)" if given == "multi_modal_data" else given
            raise InvalidRequestError(f"Beam search does not take {what}.", "use_beam_search")
