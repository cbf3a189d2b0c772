"""POST /v1/chat/completions: render the chat, tokenize, generate, answer JSON or SSE.

The endpoint calls each stage below it once, top to bottom: the tools and parsers
(``chat_parsing.py``), stage 2 (rendering and the engine's preprocessor, with the request's
SamplingParams from ``sampling.py``), the budgets, the generation (``generation.py``), then the
answer (``chat_output.py``: read here for JSON, or handed to the SSE driver, ``sse_stream.py``).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

import trio

from trillm.engine.chat_media import multi_modal_data
from trillm.engine.chat_template import ChatTemplateError
from trillm.engine.multimodal import processor_text
from trillm.engine.preprocess import PreparedPrompt
from trillm.engine.text_tokenizer import INLINE_TOKENIZE_CHARS
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.beam_search import beam_params
from trillm.entrypoints.openai.endpoints.budgets import LogprobBudget, check_sequences
from trillm.entrypoints.openai.endpoints.chat_output import ChatAnswer
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
from trillm.entrypoints.openai.endpoints.media import check_mm_kwargs, split_images, with_media_io
from trillm.entrypoints.openai.endpoints.sampling import build_sampling_params, truncate_right
from trillm.entrypoints.openai.endpoints.sse_stream import sse_stream
from trillm.entrypoints.openai.http.errors import (
    BadRequestError,
    from_engine_exception,
)
from trillm.entrypoints.openai.schemas.protocol import (
    CHAT_REASONING_EFFORTS,
    ChatCompletionRequest,
)
from trillm.messages import MultiModalItem
from trillm.sampling_extras import logprob_cap


async def create_chat_completion(
    state: ServerState, req: ChatCompletionRequest
) -> dict[str, Any] | AsyncIterator[bytes]:
    answer, gen = await start_chat(state, req)
    if req.stream:
        usage = answer.include_usage
        return guard_stream(gen, sse_stream(gen, answer, answer.tracker, usage))
    return await answer.full(gen)


async def start_chat(
    state: ServerState, req: ChatCompletionRequest
) -> tuple[ChatAnswer, Generation]:
    """Check, render, tokenize and submit a chat; the answer reads the generation (its
    ``full``, the SSE driver, or another API's reader: /v1/responses)."""
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
    model_name = state.model_name if lora is None else lora.lora_name
    reasoning = reasoning_factory(state, req, prompt_text)
    parser = None
    if tools.parser is not None or reasoning is not None:
        # NOTE: a partial, not a lambda: the answer builds its parsers from chat_parsing
        # without calling back into this module.
        parser = partial(ChoiceParser, tools, reasoning, req.include_reasoning)
    answer = ChatAnswer(state, req, params, request_id, prompt_ids, model_name, parser)
    beam = beam_params(req, [prepared])
    try:
        gen = await start_generation(
            state,
            [prepared],
            request_id,
            timeout=req.timeout,
            lora_request=lora,
            beam=beam,
            stream_interval=req.stream_interval,
        )
    except BadRequestError as exc:
        raise tools.blame(exc) from None  # a tool schema that does not compile names the tool
    return answer, gen


async def _prepare(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan
) -> tuple[PreparedPrompt, str]:
    """Stage 2 through the engine's preprocessor: render, tokenize, then truncate and check
    once (context, vocabulary, KV cache). Returns the prepared prompt and the rendered text."""
    ids, items, text = await prompt_tokens(state, req, tools)
    kept = truncate_right(req, ids, state.preprocessor.max_model_len)
    if kept is not None and items:
        raise BadRequestError(
            "truncation_side 'right' with images or audio is not supported.", "truncation_side"
        )
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
    prepared = state.preprocessor.prepare_ids(
        ids if kept is None else kept,
        params,
        text=text if kept is None or len(kept) == len(ids) else None,
        priority=req.priority,
        cache_salt=req.cache_salt,
        prompt_param="messages",
        max_tokens_param=param,
    )
    prepared.mm_items = items
    return prepared, text


async def prompt_tokens(
    state: ServerState, req: ChatCompletionRequest, tools: ToolPlan
) -> tuple[list[int], list[MultiModalItem], str]:
    """The chat's prompt as the model sees it: its token ids (images expanded), its images
    (processed) and the rendered text. /v1/messages/count_tokens counts the same ids."""
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
    images = with_media_io(images, req.media_io_kwargs)  # which frames a video keeps
    render = partial(
        pre.render_chat,
        messages,
        chat_template=req.chat_template,  # None: the engine's --chat-template or the model's
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=_template_kwargs(req),
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
    # NOTE: the template writes the special tokens itself (BOS included where the model has
    # one); add_special_tokens (vLLM's, off by default) adds the tokenizer's on top.
    truncating = req.truncate_prompt_tokens is not None
    # with images: as the model's processor writes it (Gemma 3: newlines around each image)
    tokenized = processor_text(pre.multimodal, text) if images else text
    ids = await pre.tokenize(
        tokenized, req.add_special_tokens, param="messages", truncating=truncating
    )
    items: list[MultiModalItem] = []
    if images:  # stage 3: placeholders expanded, images processed
        kwargs = req.mm_processor_kwargs
        ids, items = await pre.multimodal_ids(ids, multi_modal_data(images), truncating, kwargs)
    else:
        check_mm_kwargs(pre, req.mm_processor_kwargs)
    return ids, items, text


def _template_kwargs(req: ChatCompletionRequest) -> dict[str, Any] | None:
    """The template's keywords: the request's, with ``reasoning_effort`` over them and
    ``enable_thinking`` (any effort but "none") unless they set it, as vLLM renders them."""
    effort = req.reasoning_effort
    if effort is None:
        return req.chat_template_kwargs
    if effort not in CHAT_REASONING_EFFORTS:
        raise BadRequestError(
            f"'reasoning_effort' must be one of {', '.join(CHAT_REASONING_EFFORTS)}, got "
            f"{effort!r}.",
            "reasoning_effort",
        )
    kwargs = {**(req.chat_template_kwargs or {}), "reasoning_effort": effort}
    kwargs.setdefault("enable_thinking", effort != "none")
    return kwargs


def _top_logprobs(state: ServerState, req: ChatCompletionRequest) -> int | None:
    top = req.top_logprobs
    if top and not req.logprobs:  # (0 without logprobs asks nothing, as in vLLM)
        raise BadRequestError("'top_logprobs' requires 'logprobs' to be true.", "top_logprobs")
    vocab = state.preprocessor.vocab_size
    if top == -1:  # vLLM's: the whole vocabulary
        top = vocab
    if top is not None and top > logprob_cap(state.max_logprobs, vocab):
        whole = " (-1: the whole vocabulary)" if req.top_logprobs == -1 else ""
        raise BadRequestError(
            f"'top_logprobs' is {top}{whole}, more than the server's limit of "
            f"{state.max_logprobs} (--max-logprobs).",
            "top_logprobs",
        )
    return (top or 0) if req.logprobs else None


def _chat_size(req: ChatCompletionRequest) -> int:
    """Characters (and content parts) a chat's rendering walks over, counted cheaply."""
    size = 0
    for m in req.messages:
        content = m.content
        size += 1 + (len(content) if isinstance(content, str) else len(content or ()) * 16)
        size += 16 * len(m.tool_calls or ())  # each call is rendered as a block of text
    return size + 16 * len(req.tools or ())
