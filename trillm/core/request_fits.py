"""Admission's first check, shared by both scheduler twins: can a request ever be served?"""

from __future__ import annotations

from trillm.core.errors import RequestTooLargeError
from trillm.messages import EngineCoreRequest
from trillm.utils import cdiv


def check_request_fits(
    req: EngineCoreRequest, max_model_len: int, num_blocks: int, block_size: int
) -> None:
    """Admission: raise RequestTooLargeError when the request can never be served."""
    num_prompt = len(req.prompt_token_ids)
    if num_prompt == 0:
        raise ValueError(f"Request {req.request_id!r} has an empty prompt.")
    max_tokens = req.sampling_params.max_tokens
    if max_tokens is None:
        if num_prompt >= max_model_len:
            raise RequestTooLargeError(
                f"The prompt ({num_prompt} tokens) leaves no room to generate within "
                f"max_model_len={max_model_len}."
            )
        total = max_model_len
    else:
        total = num_prompt + max_tokens
        if total > max_model_len:
            raise RequestTooLargeError(
                f"The prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) is {total} "
                f"tokens, more than max_model_len={max_model_len}."
            )
    blocks = cdiv(total, block_size)
    if blocks > num_blocks:
        raise RequestTooLargeError(
            f"The request needs up to {total} tokens ({blocks} KV blocks of {block_size}), "
            f"more than the KV cache holds ({num_blocks} blocks)."
        )
