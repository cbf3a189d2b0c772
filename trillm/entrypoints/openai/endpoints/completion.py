"""POST /v1/completions: prompts as text or token ids (one or many), JSON or SSE answers.

With several prompts each runs as its own engine request; choice ``i * n + j`` is sample ``j``
of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import attrs
import orjson
import trio

from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.endpoints.base import (
    ChoiceState,
    RequestTracker,
    ServerState,
    position_logprobs,
    prompt_logprobs_json,
    raise_if_error,
    split_prompts,
)
from trillm.entrypoints.openai.endpoints.budgets import LogprobBudget, check_sequences
from trillm.entrypoints.openai.endpoints.generation import (
    Generation,
    guard_stream,
    start_generation,
)
from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params
from trillm.entrypoints.openai.endpoints.sse_stream import SSEStream
from trillm.entrypoints.openai.http.errors import (
    BadRequestError,
    from_engine_exception,
)
from trillm.entrypoints.openai.schemas.protocol import CompletionRequest


@attrs.define
class _Prompt:
    prepared: PreparedPrompt  # checked by the engine's preprocessor, submitted as is
    text: str | None  # the prompt text when echo needs it

    @property
    def token_ids(self) -> list[int]:
        return self.prepared.prompt_token_ids


async def create_completion(
    state: ServerState, req: CompletionRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    lora = state.check_model(req.model)  # the adapter req.model names, if any
    _check_unsupported(req)
    if req.logprobs is not None and req.logprobs > state.max_logprobs:
        raise BadRequestError(
            f"'logprobs' is {req.logprobs}, more than the server's limit of {state.max_logprobs}.",
            "logprobs",
        )
    raw_prompts = split_prompts(req.prompt, "prompt")
    check_sequences(len(raw_prompts), req.n, state.max_sequences_per_request)
    budget = LogprobBudget(state.max_logprob_entries, "logprobs", req.n)
    try:
        prompts = [await _prepare(state, req, p, budget) for p in raw_prompts]
    except ValueError as exc:  # the preprocessor's refusals name their field: 400
        raise from_engine_exception(exc) from exc
    request_id = req.request_id or f"cmpl-{uuid.uuid4().hex}"
    ctx = _CompletionContext(state, req, prompts, request_id)
    if lora is not None:
        ctx.model_name = lora.lora_name
    jobs = [p.prepared for p in prompts]
    gen = await start_generation(state, jobs, request_id, timeout=req.timeout, lora_request=lora)
    if req.stream:
        return guard_stream(gen, ctx.stream(gen))
    return await ctx.full(gen)


def _check_unsupported(req: CompletionRequest) -> None:
    if req.suffix is not None:
        raise BadRequestError("'suffix' is not supported.", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise BadRequestError("'best_of' different from 'n' is not supported.", "best_of")


async def _prepare(
    state: ServerState, req: CompletionRequest, prompt: str | list[int], budget: LogprobBudget
) -> _Prompt:
    """Stage 2 through the engine's preprocessor: tokenize (or check the ids), then truncate
    and check once (context, vocabulary, KV cache) with the request's SamplingParams; then
    spend the request's logprob budget (a 400 before the next prompt is tokenized)."""
    pre = state.preprocessor
    if isinstance(prompt, str):
        truncating = req.truncate_prompt_tokens is not None
        ids = await pre.tokenize(prompt, req.add_special_tokens, truncating=truncating)
        text: str | None = prompt
    else:
        pre.check_token_ids(prompt, "prompt")
        ids, text = prompt, None
    params = build_sampling_params(state, req, max_tokens=req.max_tokens, logprobs=req.logprobs)
    if req.echo and req.logprobs is not None:
        # Echoed prompt tokens carry their logprobs too: ask the engine for them.
        params.prompt_logprobs = max(params.prompt_logprobs or 0, req.logprobs)
    prepared = pre.prepare_ids(
        ids, params, text=text, priority=req.priority, cache_salt=req.cache_salt
    )
    budget.spend(prepared)
    echo = None
    if req.echo:  # the text of the ids served (a truncated prompt: the kept part)
        echo = prepared.text
        if echo is None:
            echo = state.tokenizer.decode(prepared.prompt_token_ids)
    return _Prompt(prepared, echo)


class _CompletionContext(SSEStream):
    def __init__(
        self, state: ServerState, req: CompletionRequest, prompts: list[_Prompt], request_id: str
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.request_id = request_id
        self.n = req.n
        self.created = int(time.time())
        self.tracker = RequestTracker(
            state, sum(len(p.token_ids) for p in prompts), (req.n, req.max_tokens, len(prompts))
        )
        self.model_name = state.model_name  # the adapter's name when the request names one

    # ------------------------------------------------------------ non-streaming

    async def full(self, gen: Generation) -> dict[str, Any]:
        num = len(self.prompts) * self.n
        choices = [ChoiceState(i) for i in range(num)]
        prompt_logprobs: list[Any] = [None] * len(self.prompts)
        try:
            async for job, item in gen:
                out = raise_if_error(item)
                self.tracker.observe(out, job)
                if out.prompt_logprobs is not None:
                    prompt_logprobs[job] = out.prompt_logprobs
                for c in out.outputs:
                    choices[job * self.n + c.index].add(c)
        finally:
            await gen.aclose()
            self.tracker.finish(num)
        # NOTE: each prompt's prompt_logprobs serialized once (shared by its n choices), in
        # slices between event-loop checkpoints; a checkpoint after each choice too.
        prompt_json: list[orjson.Fragment | None] = [None] * len(self.prompts)
        if self.req.prompt_logprobs is not None:
            prompt_json = [await prompt_logprobs_json(p) for p in prompt_logprobs]
        body_choices = []
        for c in choices:
            job = c.index // self.n
            body_choices.append(self._choice(c, prompt_logprobs[job], prompt_json[job]))
            await trio.lowlevel.checkpoint()
        return {
            "id": self.request_id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model_name,
            "choices": body_choices,
            "usage": self.tracker.usage(),
        }

    def _choice(
        self, c: ChoiceState, prompt_logprobs: Any, prompt_json: orjson.Fragment | None
    ) -> dict[str, Any]:
        prompt = self.prompts[c.index // self.n]
        echo = prompt.text if self.req.echo else None
        choice: dict[str, Any] = {
            "index": c.index,
            "text": (echo or "") + c.text,
            "logprobs": self._logprobs(prompt, c.token_ids, c.logprobs, prompt_logprobs),
            "finish_reason": c.finish_reason or "abort",
            "stop_reason": c.stop_reason,
        }
        if self.req.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_json
        if self.req.return_token_ids:
            choice["prompt_token_ids"] = prompt.token_ids
            choice["token_ids"] = c.token_ids
        return choice

    def _logprobs(
        self,
        prompt: _Prompt,
        token_ids: list[int],
        logprobs: Any,
        prompt_logprobs: Any = None,
        offset: int = 0,
    ) -> dict[str, Any] | None:
        if self.req.logprobs is None:
            return None
        tokens: list[str] = []
        values: list[float | None] = []
        tops: list[dict[str, float] | None] = []
        if self.req.echo and prompt_logprobs is not None:
            for tid, entry in zip(prompt.token_ids, prompt_logprobs):
                self._position(tid, entry, tokens, values, tops)
        for tid, entry in zip(token_ids, logprobs or []):
            self._position(tid, entry, tokens, values, tops)
        offsets = []
        for t in tokens:
            offsets.append(offset)
            offset += len(t)
        return {
            "tokens": tokens,
            "token_logprobs": values,
            "top_logprobs": tops,
            "text_offset": offsets,
        }

    def _position(self, tid: int, entry: Any, tokens: list, values: list, tops: list) -> None:
        as_ids = self.req.return_tokens_as_token_ids
        # (the first prompt token has no entry: its text from the same cache)
        lp = entry.get(tid) if entry is not None else None
        text = (lp.decoded_token or "") if lp is not None else self.state.token_text(tid)
        tokens.append(f"token_id:{tid}" if as_ids else text)
        if entry is None:  # the first prompt token: nothing predicts it
            values.append(None)
            tops.append(None)
            return
        chosen, ranked = position_logprobs(entry, tid)
        values.append(chosen)
        top = ranked[: self.req.logprobs]
        tops.append({(f"token_id:{i}" if as_ids else t): lp for i, t, lp in top})

    # ------------------------------------------------------------ streaming

    OBJECT = b"text_completion"

    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def single_job(self) -> bool:
        return len(self.prompts) == 1

    def opening(self) -> tuple[bytes, list[bytes]]:
        self._fast = self.req.logprobs is None and not self.req.return_token_ids
        self._offsets = [0] * self.num_choices()
        echo = b""
        if self.req.echo:
            echo = b"".join(self._echo_chunk(i, self._offsets) for i in range(self.num_choices()))
        return echo, []

    def add_events(self, parts: list[bytes], job: int, c: Any) -> int:
        index = job * self.n + c.index
        if self._fast and c.finish_reason is None:
            if c.text:
                parts.append(self._text_chunk(index, c.text))
        elif c.text or c.token_ids or c.finish_reason is not None:
            parts.append(self._chunk(index, c, self._offsets))
        return index

    def abort_event(self, index: int) -> bytes:
        return self._end_chunk(index, "abort")

    def _echo_chunk(self, index: int, offsets: list[int]) -> bytes:
        text = self.prompts[index // self.n].text or ""
        offsets[index] = len(text)
        return self._text_chunk(index, text)

    def _text_chunk(self, index: int, text: str) -> bytes:
        # NOTE: the hot path of streaming: no dict, one orjson call for the text.
        return (
            self.head
            + b'{"index":'
            + str(index).encode()
            + b',"text":'
            + orjson.dumps(text)
            + b',"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def _end_chunk(self, index: int, reason: str) -> bytes:
        choice = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        return self.head + orjson.dumps(choice) + b"]}\n\n"

    def _chunk(self, index: int, c: Any, offsets: list[int]) -> bytes:
        prompt = self.prompts[index // self.n]
        choice: dict[str, Any] = {
            "index": index,
            "text": c.text,
            "logprobs": self._logprobs(prompt, c.token_ids, c.logprobs, offset=offsets[index]),
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        offsets[index] += len(c.text)
        if self.req.return_token_ids:
            choice["token_ids"] = c.token_ids
        tail = b"]}\n\n"
        opts = self.req.stream_options
        if opts is not None and opts.continuous_usage_stats:
            tail = b'],"usage":' + orjson.dumps(self.tracker.usage()) + b"}\n\n"
        return self.head + orjson.dumps(choice) + tail
