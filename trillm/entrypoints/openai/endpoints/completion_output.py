"""What a completion's answer says (stage 11 of POST /v1/completions): its JSON body, read
from the generation here, and its SSE chunks, which the driver (``sse_stream.py``) asks for
output by output. Choice ``i * n + j`` is sample ``j`` of prompt ``i``, as in OpenAI's API.
"""

from __future__ import annotations

import time
from typing import Any

import attrs
import orjson
import trio

from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.endpoints.answer_json import (
    chunk_head,
    position_logprobs,
    prompt_logprobs_json,
)
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.generation import Generation, raise_if_error
from trillm.entrypoints.openai.endpoints.usage import (
    ChoiceState,
    RequestTracker,
    stream_usage,
)
from trillm.entrypoints.openai.schemas.protocol import CompletionRequest
from trillm.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs


@attrs.define
class CompletionPrompt:
    prepared: PreparedPrompt  # checked by the engine's preprocessor, submitted as is
    text: str | None  # the prompt text when echo needs it

    @property
    def token_ids(self) -> list[int]:
        return self.prepared.prompt_token_ids


class CompletionAnswer:
    """One completion request's answer: ``full`` reads the generation into the JSON body;
    the other methods are the driver's ``Chunks``."""

    def __init__(
        self,
        state: ServerState,
        req: CompletionRequest,
        prompts: list[CompletionPrompt],
        request_id: str,
        model_name: str,  # the served name, or the adapter's when the request names one
    ) -> None:
        self.state = state
        self.req = req
        self.prompts = prompts
        self.request_id = request_id
        self.n = req.n
        self.created = int(time.time())
        self.model_name = model_name
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        params = (req.n, req.max_tokens, len(prompts))
        details = state.enable_prompt_tokens_details
        trace = None
        if state.tracing is not None and prompts:  # its prompts share the sampling parameters
            trace = state.tracing.request(prompts[0].prepared.params, model_name)
        self.tracker = RequestTracker(state.metrics, prompt_tokens, params, details, trace)
        force = state.enable_force_include_usage
        self.include_usage, self._continuous_usage = stream_usage(req.stream_options, force)
        as_ids = req.return_tokens_as_token_ids
        self._as_ids = state.return_tokens_as_token_ids if as_ids is None else as_ids
        self.head = chunk_head(request_id, b"text_completion", self.created, model_name)
        plain = req.logprobs is None and not req.return_token_ids
        self._fast = plain and not self._continuous_usage
        self._offsets = [0] * self.num_choices()  # each choice's text offset so far
        # echo with logprobs: as vLLM, the echo goes with each choice's first output, its
        # logprobs the prompt's then the output's (the prompt's arrive with the first output)
        self._echo_pending = [bool(req.echo and req.logprobs is not None)] * self.num_choices()
        self._prompt_logprobs: list[PromptLogprobs | None] = [None] * len(prompts)

    # ------------------------------------------------------------ non-streaming

    async def full(self, gen: Generation) -> dict[str, Any]:
        num = len(self.prompts) * self.n
        choices = [ChoiceState(i) for i in range(num)]
        prompt_logprobs: list[PromptLogprobs | None] = [None] * len(self.prompts)
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
        for state in choices:
            job = state.index // self.n
            body_choices.append(self._choice(state, prompt_logprobs[job], prompt_json[job]))
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
        self,
        c: ChoiceState,
        prompt_logprobs: PromptLogprobs | None,
        prompt_json: orjson.Fragment | None,
    ) -> dict[str, Any]:
        prompt = self.prompts[c.index // self.n]
        echo = prompt.text if self.req.echo else None
        choice: dict[str, Any] = {
            "index": c.index,
            "text": (echo or "") + c.text,
            "logprobs": self._logprobs(prompt, c.token_ids, c.logprobs, prompt_logprobs),
            "finish_reason": c.finish_reason or "abort",
            "stop_reason": c.stop_reason,
            # vLLM's keys, null unless asked for.
            "prompt_logprobs": prompt_json if self.req.prompt_logprobs is not None else None,
            "prompt_token_ids": prompt.token_ids if self.req.return_token_ids else None,
            "token_ids": c.token_ids if self.req.return_token_ids else None,
        }
        return choice

    def _logprobs(
        self,
        prompt: CompletionPrompt,
        token_ids: list[int],
        logprobs: SampleLogprobs | None,
        prompt_logprobs: PromptLogprobs | None = None,
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
        for tid, sampled in zip(token_ids, logprobs or []):
            self._position(tid, sampled, tokens, values, tops)
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

    def _position(
        self,
        tid: int,
        entry: dict[int, Logprob] | None,
        tokens: list[str],
        values: list[float | None],
        tops: list[dict[str, float] | None],
    ) -> None:
        as_ids = self._as_ids
        # (the first prompt token has no entry: its text from the same cache)
        lp = entry.get(tid) if entry is not None else None
        text = (lp.decoded_token if lp is not None else self.state.engine.token_text(tid)) or ""
        tokens.append(f"token_id:{tid}" if as_ids else text)
        if entry is None:  # the first prompt token: nothing predicts it
            values.append(None)
            tops.append(None)
            return
        listed = bool(self.req.logprob_token_ids)  # the sampled token and the ids (vLLM's)
        chosen, ranked = position_logprobs(entry, tid, listed)
        values.append(chosen)
        # As vLLM (and OpenAI's API): the top ``logprobs`` and the chosen token, by rank.
        n = self.req.logprobs or 0
        top = ranked if listed else [r for k, r in enumerate(ranked) if k < n or r[0] == tid]
        tops.append({(f"token_id:{i}" if as_ids else t): lp for i, t, lp in top})

    # ------------------------------------------------------------ streaming (Chunks)

    def num_choices(self) -> int:
        return len(self.prompts) * self.n

    def single_job(self) -> bool:
        return len(self.prompts) == 1

    def opening(self) -> tuple[bytes, list[bytes]]:
        echo = b""
        if self.req.echo and self.req.logprobs is None:
            echo = b"".join(self._echo_chunk(i) for i in range(self.num_choices()))
        return echo, []

    def add_events(
        self,
        parts: list[bytes],
        job: int,
        c: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,
    ) -> int:
        index = job * self.n + c.index
        if prompt_logprobs is not None:
            self._prompt_logprobs[job] = prompt_logprobs
        if self._echo_pending[index]:
            self._echo_pending[index] = False
            parts.append(self._chunk(index, c, echo=True))
        elif self._fast and c.finish_reason is None:
            if c.text:
                parts.append(self._text_chunk(index, c.text))
        elif c.text or c.token_ids or c.finish_reason is not None:
            parts.append(self._chunk(index, c))
        return index

    def abort_event(self, index: int) -> bytes:
        return self._end_chunk(index, "abort")

    def _echo_chunk(self, index: int) -> bytes:
        text = self.prompts[index // self.n].text or ""
        self._offsets[index] = len(text)
        return self._text_chunk(index, text)

    def _text_chunk(self, index: int, text: str) -> bytes:
        # NOTE: the hot path of streaming: no dict, one orjson call for the text.
        return (
            self.head
            + b'{"index":'
            + str(index).encode()
            + b',"text":'
            + orjson.dumps(text)
            + b',"logprobs":null,"finish_reason":null}]'
            + self._tail()
        )

    def _tail(self) -> bytes:
        """A chunk's end after its choices: with the usage so far under continuous usage."""
        if self._continuous_usage:
            return b',"usage":' + orjson.dumps(self.tracker.usage()) + b"}\n\n"
        return b"}\n\n"

    def _end_chunk(self, index: int, reason: str) -> bytes:
        choice = {
            "index": index,
            "text": "",
            "logprobs": None,
            "finish_reason": reason,
            "stop_reason": None,
        }
        return self.head + orjson.dumps(choice) + b"]" + self._tail()

    def _chunk(self, index: int, c: CompletionOutput, echo: bool = False) -> bytes:
        """Choice ``index``'s chunk for output ``c``; ``echo``: the prompt's text and logprobs
        before the output's."""
        job = index // self.n
        prompt = self.prompts[job]
        prompt_logprobs = self._prompt_logprobs[job] if echo else None
        offset = self._offsets[index]
        text = (prompt.text or "") + c.text if echo else c.text
        logprobs = self._logprobs(prompt, c.token_ids, c.logprobs, prompt_logprobs, offset)
        choice: dict[str, Any] = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": c.finish_reason,
            "stop_reason": c.stop_reason,
        }
        self._offsets[index] += len(text)
        if self.req.return_token_ids:
            choice["token_ids"] = c.token_ids
        return self.head + orjson.dumps(choice) + b"]" + self._tail()
