"""POST /tokenize and POST /detokenize (vLLM's extension endpoints)."""

from __future__ import annotations

from typing import Any

from trillm.engine.chat_template import ChatTemplateError
from trillm.engine.preprocess import InvalidRequestError
from trillm.entrypoints.openai.errors import BadRequestError
from trillm.entrypoints.openai.protocol import DetokenizeRequest, TokenizeRequest
from trillm.entrypoints.openai.serving_base import ServerState


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
    try:
        ids = await state.preprocessor.tokenize(text, add_special)
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    body: dict[str, Any] = {
        "count": len(ids),
        "max_model_len": state.model_config.max_model_len,
        "tokens": ids,
    }
    if req.return_token_strs:
        body["token_strs"] = state.tokenizer.convert_ids_to_tokens(ids)
    return body


def _render(state: ServerState, req: TokenizeRequest) -> str:
    try:
        return state.preprocessor.render_chat(
            req.messages or [],
            add_generation_prompt=req.add_generation_prompt and not req.continue_final_message,
            continue_final_message=req.continue_final_message,
            chat_template_kwargs=req.chat_template_kwargs,
        )
    except ChatTemplateError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


async def detokenize(state: ServerState, req: DetokenizeRequest) -> dict[str, Any]:
    state.check_model(req.model)
    try:
        state.preprocessor.check_token_ids(req.tokens, "tokens")
    except InvalidRequestError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
    return {"prompt": state.tokenizer.decode(req.tokens)}
