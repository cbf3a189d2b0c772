"""POST /tokenize and POST /detokenize (vLLM's extension endpoints).

The same limits and off-loop work as chat completions: a chat of at most MAX_CHAT_MESSAGES
messages (checked while structuring), rendered on a worker thread when large; a text too long
for the context refused before tokenizing (``Preprocessor.tokenize``); at most
DETOKENIZE_CONTEXTS x max_model_len ids detokenized, large lists on a worker thread. Threads
run under the tokenization limiter, so these routes cannot take more CPU at once than
generation's tokenizing does.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import trio

from trillm.engine.chat_media import multi_modal_data
from trillm.engine.chat_template import ChatTemplateError, normalize_tools
from trillm.engine.multimodal import processor_text
from trillm.engine.preprocess import InvalidRequestError, Preprocessor
from trillm.engine.skipped_tokenizer import TokenizerSkipped
from trillm.engine.text_tokenizer import INLINE_TOKENIZE_CHARS
from trillm.entrypoints.openai.endpoints.base import ServerState
from trillm.entrypoints.openai.endpoints.media import check_mm_kwargs, split_images
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import (
    ChatMessage,
    DetokenizeRequest,
    TokenizeRequest,
)

# NOTE: no one sequence of this model is longer than max_model_len ids; 16 contexts' worth
# leaves room for a client that decodes several outputs joined, and bounds the work (7M ids
# took 2.7 s) by the model, not by the 16 MiB body.
DETOKENIZE_CONTEXTS = 16
INLINE_DETOKENIZE_IDS = 4_096  # shorter lists are decoded on the event loop (~1 ms)


def _need_tokenizer(pre: Preprocessor, route: str) -> None:
    """These routes are the tokenizer's: refused by name under --skip-tokenizer-init."""
    if pre.tokenizer_skipped:
        raise BadRequestError(str(TokenizerSkipped(route)), None)


async def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequestError("Give exactly one of 'prompt' and 'messages'.", "prompt")
    pre = state.preprocessor
    _need_tokenizer(pre, "/tokenize")
    images: list[Any] = []
    if req.messages is not None:
        messages, images = split_images(pre, req.messages)  # image parts: placeholders
        text = await _render(state, req, messages)
        if images:  # as the model's processor writes it (Gemma 3: newlines around each image)
            text = processor_text(pre.multimodal, text)
        # The template writes the special tokens; true adds the tokenizer's on top (vLLM).
        add_special = bool(req.add_special_tokens)
        param = "messages"
    else:
        text = req.prompt or ""
        add_special = req.add_special_tokens is not False
        param = "prompt"
    # NOTE: the same limits as generation (this route is open without the API key, as in
    # vLLM): a text too long for the context is refused before tokenizing, and long texts
    # wait for one of a few tokenizer threads.
    try:
        ids = await pre.tokenize(text, add_special, param=param)
        if images:  # the expanded prompt, as a completion sees it (placeholders counted)
            kwargs = req.mm_processor_kwargs
            ids, _ = await pre.multimodal_ids(ids, multi_modal_data(images), False, kwargs)
        else:
            check_mm_kwargs(pre, req.mm_processor_kwargs)
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.model_config.max_model_len,
        "tokens": ids,
        "token_strs": None,  # vLLM's key, null unless return_token_strs
    }
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return body


async def _render(state: ServerState, req: TokenizeRequest, messages: list[ChatMessage]) -> str:
    pre = state.preprocessor
    render = partial(
        pre.render_chat,
        messages,
        add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
        continue_final_message=req.continue_final_message,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=normalize_tools(req.tools),  # as chat renders them (vLLM's /tokenize does too)
    )
    try:
        if _chat_size(messages) < INLINE_TOKENIZE_CHARS:
            return render()
        # NOTE: a chat of 100,000 messages renders for about a second: not on the event loop
        return await trio.to_thread.run_sync(render, limiter=pre.tokenize_limiter)
    except ChatTemplateError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


def _chat_size(messages: list[ChatMessage]) -> int:
    """Characters (and content parts) the rendering walks over, counted cheaply (as chat's)."""
    size = 0
    for m in messages:
        content = m.content
        size += 1 + (len(content) if isinstance(content, str) else len(content or ()) * 16)
        size += 16 * len(m.tool_calls or ())
    return size


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    pre = state.preprocessor
    _need_tokenizer(pre, "/detokenize")
    limit = DETOKENIZE_CONTEXTS * pre.max_model_len
    if len(req.tokens) > limit:
        raise BadRequestError(
            f"'tokens' has {len(req.tokens)} ids; at most {limit} ({DETOKENIZE_CONTEXTS} x the "
            f"maximum context length of {pre.max_model_len}) are detokenized at once.",
            "tokens",
        )

    def decode() -> str:
        pre.check_token_ids(req.tokens, "tokens")
        return str(state.tokenizer.decode(req.tokens))

    try:
        if len(req.tokens) < INLINE_DETOKENIZE_IDS:
            return {"prompt": decode()}
        return {"prompt": await trio.to_thread.run_sync(decode, limiter=pre.tokenize_limiter)}
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
