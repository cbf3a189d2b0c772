"""What a chat completion's answer says (stage 11 of POST /v1/chat/completions): its JSON
body, read from the generation here, and its SSE chunks, which the driver (``sse_stream.py``)
asks for output by output; a choice's text goes through its reasoning / tool-call parser
(``chat_parsing.ChoiceParser``) when the request has one. /v1/responses reads the same answer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import orjson

from trillm.entrypoints.openai.endpoints.answer_json import (
    chunk_head,
    position_logprobs,
    prompt_logprobs_json,
)
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.chat_parsing import ChoiceParser
from trillm.entrypoints.openai.endpoints.generation import Generation, raise_if_error
from trillm.entrypoints.openai.endpoints.usage import (
    ChoiceState,
    RequestTracker,
    stream_usage,
)
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
from trillm.outputs import CompletionOutput, Logprob, PromptLogprobs, SampleLogprobs
from trillm.sampling_params import SamplingParams


def _echo_text(req: ChatCompletionRequest) -> str:
    """``echo``: the last message's text when it is the assistant's (the reply's role)."""
    last = req.messages[-1] if req.echo and req.messages else None
    if last is None or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(part.text or "" for part in last.content if part.type == "text")


class ChatAnswer:
    """One chat request's answer: ``full`` reads the generation into the JSON body; the
    other public methods are the driver's ``Chunks``."""

    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        params: SamplingParams,
        request_id: str,
        prompt_ids: list[int],
        model_name: str,  # the served name, or the adapter's when the request names one
        # Per-choice reasoning / tool-call parsing (chat_parsing.py); None: the text as is.
        parser: Callable[[], ChoiceParser] | None,
    ) -> None:
        self.state = state
        self.req = req
        self.params = params
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        max_tokens = req.max_completion_tokens or req.max_tokens
        self.tracker = RequestTracker(
            state.metrics,
            len(prompt_ids),
            (req.n, max_tokens, 1),
            details=state.enable_prompt_tokens_details,
            trace=None if state.tracing is None else state.tracing.request(params, model_name),
            report_created=True,
        )
        force = state.enable_force_include_usage
        self.include_usage, self._continuous_usage = stream_usage(req.stream_options, force)
        as_ids = req.return_tokens_as_token_ids
        self._as_ids = state.return_tokens_as_token_ids if as_ids is None else as_ids
        self.top_n = params.logprobs or 0  # top_logprobs as resolved (-1: the vocabulary)
        # logprob_token_ids: every position lists the sampled token and the ids (vLLM's)
        self._listed = bool(params.logprob_token_ids)
        self.parser = parser
        self.echo = _echo_text(req)
        self.model_name = model_name
        self.head = chunk_head(request_id, b"chat.completion.chunk", self.created, model_name)

    # ------------------------------------------------------------ non-streaming

    async def full(self, gen: Generation) -> dict[str, Any]:
        choices = [ChoiceState(i) for i in range(self.params.n)]
        prompt_logprobs: PromptLogprobs | None = None
        try:
            async for _, item in gen:
                out = raise_if_error(item)
                self.tracker.observe(out)
                if out.prompt_logprobs is not None:
                    prompt_logprobs = out.prompt_logprobs
                for c in out.outputs:
                    choices[c.index].add(c)
        finally:
            await gen.aclose()
            self.tracker.finish(self.params.n)
        return self._response(choices, await prompt_logprobs_json(prompt_logprobs))

    def _response(
        self, choices: list[ChoiceState], prompt_logprobs: orjson.Fragment | None
    ) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.request_id,
            "object": "chat.completion",
            "created": self.created,
            "model": self.model_name,
            "choices": [self._choice(c) for c in choices],
            "usage": self.tracker.usage(),
            # vLLM's keys, null unless asked for.
            "prompt_logprobs": prompt_logprobs if self.req.prompt_logprobs is not None else None,
            "prompt_token_ids": self.prompt_ids if self.req.return_token_ids else None,
        }
        return body

    def _choice(self, c: ChoiceState) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": c.text}
        finish_reason = c.finish_reason or "abort"
        if self.parser is not None:
            parser = self.parser()
            message = parser.message(c.text)
            finish_reason = parser.finish_reason(finish_reason) or finish_reason
        if self.echo:
            message["content"] = self.echo + (message.get("content") or "")
        choice: dict[str, Any] = {
            "index": c.index,
            "message": message,
            "logprobs": self._logprobs(c.token_ids, c.logprobs),
            "finish_reason": finish_reason,
            "stop_reason": c.stop_reason,
            "token_ids": c.token_ids if self.req.return_token_ids else None,
        }
        return choice

    def _text(self, entry: dict[int, Logprob], tid: int) -> str:
        lp = entry.get(tid)
        return (lp.decoded_token if lp is not None else self.state.engine.token_text(tid)) or ""

    def _logprobs(
        self, token_ids: list[int], logprobs: SampleLogprobs | None
    ) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        content = []
        # return_tokens_as_token_ids: "token_id:<id>" for tokens that are not UTF-8 alone.
        as_ids = self._as_ids
        for tid, entry in zip(token_ids, logprobs or []):
            chosen, tops = position_logprobs(entry, tid, self._listed)
            text = f"token_id:{tid}" if as_ids else self._text(entry, tid)
            shown = tops if self._listed else tops[: self.top_n]
            top = [(f"token_id:{i}" if as_ids else t, lp) for i, t, lp in shown]
            content.append(
                {
                    "token": text,
                    "logprob": chosen,
                    "bytes": list(text.encode()),
                    "top_logprobs": [
                        {"token": t, "logprob": lp, "bytes": list(t.encode())} for t, lp in top
                    ],
                }
            )
        return {"content": content}

    # ------------------------------------------------------------ streaming (Chunks)

    def num_choices(self) -> int:
        return self.params.n

    def opening(self) -> tuple[bytes, list[bytes]]:
        # NOTE: the role events (and an echo) go with the first output (already there: the
        # request was primed): fewer, larger writes; the same events at the same moments.
        self._fast = not (self.req.logprobs or self.req.return_token_ids or self._continuous_usage)
        self._parsers = [self.parser() for _ in range(self.params.n)] if self.parser else None
        parts = [self._role_chunk(i) for i in range(self.params.n)]
        if self.echo:
            parts += [self._content_chunk(i, self.echo) for i in range(self.params.n)]
        return b"", parts

    def single_job(self) -> bool:
        return True  # one prompt

    def add_events(
        self,
        parts: list[bytes],
        job: int,
        c: CompletionOutput,
        prompt_logprobs: PromptLogprobs | None,  # (a chat's echo carries no logprobs)
    ) -> int:
        if self._parsers is not None:
            p = self._parsers[c.index]
            delta = p.feed(c.text, c.finish_reason is not None)
            reason = p.finish_reason(c.finish_reason)
            if delta or reason is not None or (c.token_ids and not self._fast):
                parts.append(
                    self._chunk(c.index, delta, c.token_ids, c.logprobs, reason, c.stop_reason)
                )
        elif self._fast and c.finish_reason is None:
            if c.text:
                parts.append(self._content_chunk(c.index, c.text))
        elif c.text or c.token_ids or c.finish_reason is not None:
            parts.append(
                self._chunk(
                    c.index, c.text, c.token_ids, c.logprobs, c.finish_reason, c.stop_reason
                )
            )
        return c.index

    def abort_event(self, index: int) -> bytes:
        rest = self._parsers[index].feed("", True) if self._parsers is not None else ""
        return self._chunk(index, rest, [], None, "abort", None)

    def _role_chunk(self, index: int) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        tail = self._tail()
        if self.req.return_token_ids and index == 0:
            tail = b',"prompt_token_ids":' + orjson.dumps(self.prompt_ids) + tail
        return self.head + orjson.dumps(choice) + b"]" + tail

    def _content_chunk(self, index: int, text: str) -> bytes:
        # NOTE: the hot path of streaming: no dict, one orjson call for the text.
        return (
            self.head
            + b'{"index":'
            + str(index).encode()
            + b',"delta":{"content":'
            + orjson.dumps(text)
            + b'},"logprobs":null,"finish_reason":null}]'
            + self._tail()
        )

    def _tail(self) -> bytes:
        """A chunk's end after its choices: with the usage so far under continuous usage."""
        if self._continuous_usage:
            return b',"usage":' + orjson.dumps(self.tracker.usage()) + b"}\n\n"
        return b"}\n\n"

    def _chunk(
        self,
        index: int,
        text: str | dict[str, Any],  # the new text, or a parsed delta (chat_parsing.py)
        token_ids: list[int],
        logprobs: SampleLogprobs | None,
        finish_reason: str | None,
        stop_reason: int | str | None,
    ) -> bytes:
        delta: dict[str, Any] = (
            text if isinstance(text, dict) else {"content": text} if text else {}
        )
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": self._logprobs(token_ids, logprobs),
            "finish_reason": finish_reason,
            "stop_reason": stop_reason,
        }
        if self.req.return_token_ids:
            choice["token_ids"] = token_ids
        return self.head + orjson.dumps(choice) + b"]" + self._tail()
