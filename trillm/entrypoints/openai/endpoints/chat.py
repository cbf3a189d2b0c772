"""POST /v1/chat/completions: render the chat, tokenize, generate, answer JSON or SSE."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import partial
from typing import Any

import orjson
import trio

from trillm.engine.chat_template import ChatTemplateError
from trillm.engine.multimodal import processor_text
from trillm.engine.preprocess import INLINE_TOKENIZE_CHARS, PreparedPrompt
from trillm.entrypoints.openai.endpoints.base import (
    ChoiceState,
    RequestTracker,
    ServerState,
    position_logprobs,
    prompt_logprobs_json,
    raise_if_error,
)
from trillm.entrypoints.openai.endpoints.budgets import LogprobBudget, check_sequences
from trillm.entrypoints.openai.endpoints.chat_parsing import (
    ChoiceParser,
    ToolPlan,
    keeps_special_tokens,
    plan_tools,
    reasoning_factory,
)
from trillm.entrypoints.openai.endpoints.generation import (
    Generation,
    guard_stream,
    start_generation,
)
from trillm.entrypoints.openai.endpoints.media import check_mm_kwargs, split_images
from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params
from trillm.entrypoints.openai.endpoints.sse_stream import SSEStream
from trillm.entrypoints.openai.http.errors import (
    BadRequestError,
    from_engine_exception,
)
from trillm.entrypoints.openai.schemas.protocol import ChatCompletionRequest
from trillm.messages import MultiModalItem
from trillm.sampling_params import SamplingParams


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    ctx, gen = await start_chat(state, req)
    if req.stream:
        return guard_stream(gen, ctx.stream(gen))
    return await ctx.full(gen)


async def start_chat(
    state: ServerState, req: ChatCompletionRequest
) -> tuple[ChatContext, Generation]:
    """Check, render, tokenize and submit a chat; the context reads the generation (its
    ``full`` or ``stream``, or another API's reader: /v1/responses)."""
    lora = state.check_model(req.model)  # the adapter req.model names, if any
    tools = plan_tools(state, req)
    try:
        prepared, prompt_text = await _prepare(state, req, tools)
    except ValueError as exc:  # the preprocessor's refusals name their field: 400
        raise from_engine_exception(exc) from exc
    check_sequences(1, prepared.params.n, state.max_sequences_per_request)
    LogprobBudget(state.max_logprob_entries, "top_logprobs", 1).spend(prepared)
    params = prepared.params
    prompt_ids = prepared.prompt_token_ids
    request_id = req.request_id or f"chatcmpl-{uuid.uuid4().hex}"
    ctx = ChatContext(state, req, params, request_id, prompt_ids)
    if lora is not None:
        ctx.model_name = lora.lora_name
    reasoning = reasoning_factory(state, req, prompt_text)
    if tools.parser is not None or reasoning is not None:
        ctx.parser = lambda: ChoiceParser(tools, reasoning, req.include_reasoning)
    try:
        gen = await start_generation(
            state, [prepared], request_id, timeout=req.timeout, lora_request=lora
        )
    except BadRequestError as exc:
        raise tools.blame(exc) from None  # a tool schema that does not compile names the tool
    return ctx, gen


async def _prepare(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan
) -> tuple[PreparedPrompt, str]:
    """Stage 2 through the engine's preprocessor: render, tokenize, then truncate and check
    once (context, vocabulary, KV cache). Returns the prepared prompt and the rendered text."""
    if req.chat_template is not None and not state.trust_request_chat_template:
        raise BadRequestError(
            "Chat templates in requests are refused; start the server with "
            "--trust-request-chat-template to allow them.",
            "chat_template",
        )
    if not req.messages:
        raise BadRequestError("'messages' must not be empty.", "messages")
    pre = state.preprocessor
    messages, images = split_images(pre, req.messages)  # image parts: placeholders
    render = partial(
        pre.render_chat,
        messages,
        chat_template=req.chat_template,  # None: the engine's --chat-template or the model's
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=tools.template_tools,
        documents=req.documents,
        # A request's own template is metered: stopped past its time or size budget.
        budget=None if req.chat_template is None else pre.request_template_budget(),
    )
    try:
        if req.chat_template is None and _chat_size(req) < INLINE_TOKENIZE_CHARS:
            text = render()
        else:  # NOTE: a huge chat, or a request's template, renders for up to seconds
            text = await trio.to_thread.run_sync(render, limiter=pre.tokenize_limiter)
    except ChatTemplateError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    # NOTE: the template writes the special tokens itself (BOS included where the model has one).
    truncating = req.truncate_prompt_tokens is not None
    # with images: as the model's processor writes it (Gemma 3: newlines around each image)
    tokenized = processor_text(pre.multimodal, text) if images else text
    ids = await pre.tokenize(tokenized, False, param="messages", truncating=truncating)
    items: list[MultiModalItem] = []
    if images:  # stage 3: placeholders expanded, images processed
        kwargs = req.mm_processor_kwargs
        ids, items = await pre.multimodal_ids(ids, {"image": images}, truncating, kwargs)
    else:
        check_mm_kwargs(pre, req.mm_processor_kwargs)
    max_tokens, param = (
        (req.max_completion_tokens, "max_completion_tokens")
        if req.max_completion_tokens is not None
        else (req.max_tokens, "max_tokens")
    )
    params = build_sampling_params(
        state, req, max_tokens=max_tokens, logprobs=_top_logprobs(state, req)
    )
    if tools.structured_outputs is not None:  # "required" / named tool_choice
        params.structured_outputs = tools.structured_outputs
    if keeps_special_tokens(state.tokenizer, tools, state.reasoning_parser is not None):
        params.skip_special_tokens = False  # the parsers' markers are special tokens
    prepared = pre.prepare_ids(
        ids,
        params,
        text=text,
        priority=req.priority,
        cache_salt=req.cache_salt,
        prompt_param="messages",
        max_tokens_param=param,
    )
    prepared.mm_items = items
    return prepared, text


def _top_logprobs(state: ServerState, req: ChatCompletionRequest) -> int | None:
    if req.top_logprobs is not None and not req.logprobs:
        raise BadRequestError("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    if req.top_logprobs is not None and req.top_logprobs > state.max_logprobs:
        raise BadRequestError(
            f"'top_logprobs' is {req.top_logprobs}, more than the server's limit of "
            f"{state.max_logprobs}.",
            "top_logprobs",
        )
    return (req.top_logprobs or 0) if req.logprobs else None


def _chat_size(req: ChatCompletionRequest) -> int:
    """Characters (and content parts) a chat's rendering walks over, counted cheaply."""
    size = 0
    for m in req.messages:
        content = m.content
        size += 1 + (len(content) if isinstance(content, str) else len(content or ()) * 16)
        size += 16 * len(m.tool_calls or ())  # each call is rendered as a block of text
    return size + 16 * len(req.tools or ())


def _echo_text(req: ChatCompletionRequest) -> str:
    """``echo``: the last message's text when it is the assistant's (the reply's role)."""
    last = req.messages[-1] if req.echo and req.messages else None
    if last is None or last.role != "assistant" or last.content is None:
        return ""
    if isinstance(last.content, str):
        return last.content
    return "".join(part.text or "" for part in last.content if part.type == "text")


class ChatContext(SSEStream):
    def __init__(
        self,
        state: ServerState,
        req: ChatCompletionRequest,
        params: SamplingParams,
        request_id: str,
        prompt_ids: list[int],
    ) -> None:
        self.state = state
        self.req = req
        self.params = params
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.created = int(time.time())
        max_tokens = req.max_completion_tokens or req.max_tokens
        self.tracker = RequestTracker(state, len(prompt_ids), (req.n, max_tokens, 1))
        self.top_n = req.top_logprobs or 0
        # Per-choice reasoning / tool-call parsing (chat_parsing.py); None: the text as is.
        self.parser: Callable[[], ChoiceParser] | None = None
        self.echo = _echo_text(req)
        self.model_name = state.model_name  # the adapter's name when the request names one

    # ------------------------------------------------------------ non-streaming

    async def full(self, gen: Generation) -> dict[str, Any]:
        choices = [ChoiceState(i) for i in range(self.params.n)]
        prompt_logprobs = None
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
        }
        if self.req.prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        if self.req.return_token_ids:
            body["prompt_token_ids"] = self.prompt_ids
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
        }
        if self.req.return_token_ids:
            choice["token_ids"] = c.token_ids
        return choice

    def _text(self, entry: Any, tid: int) -> str:
        lp = entry.get(tid)
        return (lp.decoded_token or "") if lp is not None else self.state.token_text(tid)

    def _logprobs(self, token_ids: list[int], logprobs: Any) -> dict[str, Any] | None:
        if not self.req.logprobs:
            return None
        content = []
        # return_tokens_as_token_ids: "token_id:<id>" for tokens that are not UTF-8 alone.
        as_ids = self.req.return_tokens_as_token_ids
        for tid, entry in zip(token_ids, logprobs or []):
            chosen, tops = position_logprobs(entry, tid)
            text = f"token_id:{tid}" if as_ids else self._text(entry, tid)
            top = [(f"token_id:{i}" if as_ids else t, lp) for i, t, lp in tops[: self.top_n]]
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

    # ------------------------------------------------------------ streaming

    OBJECT = b"chat.completion.chunk"

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

    def add_events(self, parts: list[bytes], job: int, c: Any) -> int:
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

    @property
    def _continuous_usage(self) -> bool:
        opts = self.req.stream_options
        return opts is not None and opts.continuous_usage_stats

    def _role_chunk(self, index: int) -> bytes:
        choice: dict[str, Any] = {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        if self.req.return_token_ids and index == 0:
            return (
                self.head
                + orjson.dumps(choice)
                + (b'],"prompt_token_ids":' + orjson.dumps(self.prompt_ids) + b"}\n\n")
            )
        return self.head + orjson.dumps(choice) + b"]}\n\n"

    def _content_chunk(self, index: int, text: str) -> bytes:
        # NOTE: the hot path of streaming: no dict, one orjson call for the text.
        return (
            self.head
            + b'{"index":'
            + str(index).encode()
            + b',"delta":{"content":'
            + orjson.dumps(text)
            + b'},"logprobs":null,"finish_reason":null}]}\n\n'
        )

    def _chunk(
        self,
        index: int,
        text: str | dict[str, Any],  # the new text, or a parsed delta (chat_parsing.py)
        token_ids: list[int],
        logprobs: Any,
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
        tail = b"]}\n\n"
        if self._continuous_usage:
            tail = b'],"usage":' + orjson.dumps(self.tracker.usage()) + b"}\n\n"
        return self.head + orjson.dumps(choice) + tail
