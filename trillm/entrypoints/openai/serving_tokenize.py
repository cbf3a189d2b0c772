"""POST /tokenize and POST /detokenize (vLLM's extension endpoints)."""

from __future__ import annotations

from typing import Any

from trillm.entrypoints.chat_utils import (
    ChatTemplateError,
    render_template,
    tokenizer_chat_template,
    tokenizer_special_tokens,
)
from trillm.entrypoints.openai.errors import BadRequestError
from trillm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from trillm.entrypoints.openai.serving_base import ServerState, check_token_ids, tokenize_text


async def tokenize(state: ServerState, req: TokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise BadRequestError("Give exactly one of 'prompt' and 'messages'.", "prompt")
    if req.messages is not None:
        text = _render(state, req)
        # The template writes the special tokens; true adds the tokenizer's on top (vLLM).
        add_special = bool(req.add_special_tokens)
    else:
        text = req.prompt or ""
        add_special = req.add_special_tokens is not False
    # NOTE: the same limits as generation (this route is open without the API key, as in
    # vLLM): a text too long for the context is refused before tokenizing, and long texts
    # wait for one of a few tokenizer threads.
    ids = await tokenize_text(state, text, add_special)
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.model_config.max_model_len,
        "tokens": ids,
    }
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return body


def _render(state: ServerState, req: TokenizeRequest) -> str:
    template = state.chat_template or tokenizer_chat_template(state.tokenizer)
    try:
        return render_template(
            template,
            req.messages or [],
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            special_tokens=tokenizer_special_tokens(state.tokenizer),
            template_kwargs=req.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    check_token_ids(state, req.tokens, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
