"""Prompt embeddings (vLLM's ``--enable-prompt-embeds``): a prompt given as rows of input
embeddings [n, hidden_size] instead of token ids.

Such a prompt travels as one ``MultiModalItem`` of modality ``prompt_embeds`` covering the
whole prompt (offset 0, n rows), with n placeholder token ids (0) for the scheduler: the
worker writes its rows over the placeholders' token embeddings as it writes image features
(``trillm/worker/mm_inputs.py``), and its content hash, in ``extra_hash_keys``, keys the
prefix cache (the same embeddings hit, other embeddings do not).

Over HTTP the tensor is client-sent torch data: its size is bounded before decoding, it is
read with ``torch.load(weights_only=True)`` (tensors only, no code), and its dtype, shape and
values are checked; every refusal names ``prompt_embeds``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
from typing import TYPE_CHECKING, Any

from trillm.config import ModelConfig
from trillm.messages import PROMPT_EMBEDS_MODALITY as MODALITY
from trillm.messages import MultiModalItem
from trillm.sampling_params import SamplingParams

if TYPE_CHECKING:  # torch is imported where a tensor is read: the frontend starts without it
    import torch

PLACEHOLDER_ID = 0  # the scheduler's stand-in token id for each row (vLLM's as well)
_DTYPES = ("float32", "bfloat16", "float16")  # torch dtype names
# torch.save's zip container around the raw bytes (names, pickled metadata): a few KB.
_CONTAINER_BYTES = 64 * 1024
_FLAG = "prompt_embeds needs the server started with --enable-prompt-embeds"


class PromptEmbedsError(ValueError):
    """The prompt embeddings cannot be served as given; ``param`` names the field."""

    def __init__(self, message: str, param: str = "prompt_embeds") -> None:
        super().__init__(message)
        self.param = param


def refuse_disabled() -> PromptEmbedsError:
    return PromptEmbedsError(f"{_FLAG} (LLM(..., enable_prompt_embeds=True) in Python).")


def embeds_prompt(
    prompt: dict[str, Any], params: SamplingParams, enabled: bool, model: ModelConfig
) -> tuple[list[int], MultiModalItem]:
    """``{"prompt_embeds": tensor}`` as placeholder ids and its item: the tensor checked, its
    last rows kept under ``truncate_prompt_tokens`` (as vLLM does)."""
    if not enabled:
        raise refuse_disabled()
    others = sorted(k for k in prompt if k != "prompt_embeds")
    if others:
        raise PromptEmbedsError(f"A prompt_embeds prompt takes no other keys, got {others}.")
    if params.prompt_logprobs is not None:  # no token ids to score (vLLM refuses it too)
        raise PromptEmbedsError(
            "prompt_logprobs is not supported with prompt_embeds.", "prompt_logprobs"
        )
    max_len = model.max_model_len
    rows = check_prompt_embeds(prompt["prompt_embeds"], model.hidden_size, max_len)
    keep = params.truncate_prompt_tokens
    if keep is not None:
        rows = rows[-(max_len if keep == -1 else keep) :]
    item = embeds_item(rows)
    return [PLACEHOLDER_ID] * item.length, item


def max_encoded_chars(max_model_len: int, hidden_size: int) -> int:
    """The longest base64 text a [max_model_len, hidden_size] float32 tensor can need."""
    raw = max_model_len * hidden_size * 4 + _CONTAINER_BYTES
    return 4 * ((raw + 2) // 3)


def decode_prompt_embeds(text: Any, hidden_size: int, max_model_len: int) -> torch.Tensor:
    """One base64 ``torch.save``d tensor -> the checked [n, hidden_size] tensor."""
    import torch

    if not isinstance(text, str):
        raise PromptEmbedsError("prompt_embeds must be a base64 string or a list of them.")
    limit = max_encoded_chars(max_model_len, hidden_size)
    if len(text) > limit:
        raise PromptEmbedsError(
            f"prompt_embeds is {len(text)} base64 characters, more than [{max_model_len}, "
            f"{hidden_size}] float32 embeddings can take ({limit})."
        )
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise PromptEmbedsError("prompt_embeds is not valid base64.") from None
    try:
        tensor = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except Exception:  # a truncated zip, a pickle naming a global weights_only refuses, ...
        raise PromptEmbedsError("prompt_embeds is not a tensor saved by torch.save.") from None
    return check_prompt_embeds(tensor, hidden_size, max_model_len)


def check_prompt_embeds(tensor: Any, hidden_size: int, max_model_len: int) -> torch.Tensor:
    """A dense, finite [n, hidden_size] float32/bfloat16/float16 tensor, 1 <= n <= the context."""
    import torch

    if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
        raise PromptEmbedsError("prompt_embeds must be a dense torch tensor.")
    if str(tensor.dtype).removeprefix("torch.") not in _DTYPES:
        raise PromptEmbedsError(
            f"prompt_embeds must be float32, bfloat16 or float16, got {tensor.dtype}."
        )
    shape = list(tensor.shape)
    if len(shape) != 2 or shape[1] != hidden_size or shape[0] < 1:
        raise PromptEmbedsError(
            f"prompt_embeds must have shape [num_tokens, {hidden_size}] with num_tokens >= 1, "
            f"got {shape}."
        )
    if shape[0] > max_model_len:
        raise PromptEmbedsError(
            f"prompt_embeds has {shape[0]} rows, more than the model's maximum context length "
            f"({max_model_len})."
        )
    if not bool(torch.isfinite(tensor).all()):
        raise PromptEmbedsError("prompt_embeds holds NaN or infinite values.")
    return tensor.detach().cpu()


def embeds_item(tensor: torch.Tensor) -> MultiModalItem:
    """The prompt's one item: float32 rows (exact for the three dtypes), hashed by content."""
    import torch

    rows = tensor.to(torch.float32).contiguous()
    data = rows.numpy().tobytes()
    shape = list(rows.shape)
    digest = hashlib.sha256(data + repr(shape).encode()).hexdigest()
    return MultiModalItem(MODALITY, digest, 0, shape[0], data, shape)


def inputs_field(items: list[MultiModalItem]) -> str:
    """What a refusal of a prompt's items names: prompt_embeds or multi_modal_data."""
    return "prompt_embeds" if any(m.modality == MODALITY for m in items) else "multi_modal_data"
