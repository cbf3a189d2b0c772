"""Request schemas (attrs classes) of the chat, completion, ``/tokenize`` and ``/detokenize``
endpoints, with the pieces they share.

Ranges live in each field's metadata (``_f``: ``ge``/``gt``/``le``/``max_len``/``max_prompts``/
``max_chars``) so the OpenAPI schema (``openapi_requests.py``) is generated from the same
declaration the validator (``structuring.py``) enforces.
"""

from __future__ import annotations

from typing import Any, Literal, Union

import attrs

from trillm.sampling_extras import MAX_LOGPROB_TOKEN_IDS
from trillm.sampling_params import INT64_MAX, INT64_MIN

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_PROMPTS = 1024
MAX_BAD_WORDS = 256
# allowed_token_ids: each of a request's sequences carries and packs the whole list, n times
# for n samples: 2,000,000 ids (10 MB) with n=128 took 80 s of the event loop, in which a
# request beside it waited as long. The bound of logit_bias, the other per-token-id list.
MAX_ALLOWED_TOKEN_IDS = 4096
# cache_salt: each sample carries it and each prompt block's hash takes it in; one 8 MB salt
# with n=128 held the event loop 4.3 s (3.8 s for a request beside it).
MAX_CACHE_SALT_CHARS = 1024
MAX_REQUEST_TIMEOUT_S = 86_400.0  # a request's ``timeout``: at most a day
# A client's request_id travels with every engine step (scheduler, worker messages, every
# output): three 1 MB ids slowed a 200-token request beside them from 0.3 s to 14 s.
MAX_REQUEST_ID_CHARS = 256
MAX_CHAT_MESSAGES = 100_000  # a chat's messages, in chat completions and /tokenize
# The content parts of all a chat's messages together (each costs what a message costs; the
# routes' input items and Anthropic's content blocks too): checked before structuring.
MAX_CHAT_CONTENT_PARTS = 100_000
# vLLM's reasoning efforts of a chat completion ("max": DeepSeek V4's templates)
CHAT_REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")


def _f(default: Any = attrs.NOTHING, **limits: Any) -> Any:
    """A field with range limits in its metadata (checked by ``structuring.structure``)."""
    if isinstance(default, (list, dict)):
        return attrs.field(factory=lambda: type(default)(default), metadata=limits)
    return attrs.field(default=default, metadata=limits)


# ---------------------------------------------------------------- shared pieces


@attrs.define
class StreamOptions:
    include_usage: bool = False
    continuous_usage_stats: bool = False


@attrs.define
class JsonSchemaSpec:
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


@attrs.define
class ResponseFormat:
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaSpec | None = None
    # type "structural_tag" (vLLM): {"format": ...}, or the older {"structures", "triggers"}
    format: dict[str, Any] | None = None
    structures: list[dict[str, Any]] | None = _f(None, max_len=1024)
    triggers: list[str] | None = _f(None, max_len=1024)


@attrs.define
class StructuredOutputs:
    """vLLM's ``structured_outputs`` extension: exactly one kind set (``response_format``
    may supply it), plus the options."""

    json: Union[str, dict[str, Any], None] = None  # noqa: UP007
    regex: str | None = None
    choice: list[str] | None = _f(None, max_len=4096)
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: Union[str, dict[str, Any], None] = None  # noqa: UP007
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False


@attrs.define
class ImageURL:
    # data:, file:// (--allowed-local-media-path) or http(s) (trillm/engine/media.py).
    # OpenAI's ``detail`` is not declared: vLLM ignores it too (logged as an unknown field).
    url: str | None = None


@attrs.define
class InputAudio:
    """OpenAI's ``input_audio``: base64 ``data`` of a ``format`` file (wav; mp3 refused)."""

    data: str | None = None
    format: str | None = None


@attrs.define
class TextPart:
    """A chat content part: ``text``, ``image_url`` for a model that takes images,
    ``video_url`` (vLLM's) for one that takes videos, ``input_audio`` / ``audio_url`` (vLLM's)
    for one that takes audio."""

    type: str
    text: str | None = None
    image_url: ImageURL | None = None
    input_audio: InputAudio | None = None
    audio_url: ImageURL | None = None  # (the same {"url": ...} shape)
    video_url: ImageURL | None = None  # (likewise)


# ---------------------------------------------------------------- tools


@attrs.define
class FunctionDefinition:
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


@attrs.define
class ChatTool:
    function: FunctionDefinition
    type: Literal["function"] = "function"


@attrs.define
class NamedFunction:
    name: str


@attrs.define
class NamedToolChoice:
    function: NamedFunction
    type: Literal["function"] = "function"


@attrs.define
class FunctionCall:
    name: str
    # A JSON string (OpenAI); an object is accepted too and given to templates as is.
    arguments: Union[str, dict[str, Any]] = "{}"  # noqa: UP007


@attrs.define
class ToolCall:
    function: FunctionCall
    id: str | None = None
    type: Literal["function"] = "function"


@attrs.define
class ChatMessage:
    role: str
    content: Union[str, list[TextPart], None] = None  # noqa: UP007
    name: str | None = None
    tool_calls: list[ToolCall] | None = _f(None, max_len=1024)
    tool_call_id: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


# ---------------------------------------------------------------- sampling fields, both APIs


@attrs.define(kw_only=True)
class _SamplingFields:
    model: str | None = None
    n: int = _f(1, ge=1, le=MAX_N)
    temperature: float | None = _f(None, ge=0.0)
    top_p: float | None = _f(None, gt=0.0, le=1.0)
    presence_penalty: float | None = _f(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = _f(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = _f(None, max_len=4096)
    seed: int | None = _f(None, ge=INT64_MIN, le=INT64_MAX)
    stop: Union[str, list[str], None] = _f(None, max_len=MAX_STOP_STRINGS)  # noqa: UP007
    max_tokens: int | None = _f(None, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # vLLM extensions
    top_k: int | None = _f(None, ge=-1)
    min_p: float | None = _f(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = _f(None, gt=0.0)
    stop_token_ids: list[int] | None = _f(None, max_len=1024)
    ignore_eos: bool = False
    min_tokens: int = _f(0, ge=0)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    prompt_logprobs: int | None = _f(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    # vLLM's: the prompt logprobs from the logits divided by this (None: unscaled)
    prompt_logprobs_temperature: float | None = _f(None, gt=0.0)
    priority: int = 0
    cache_salt: str | None = _f(None, max_chars=MAX_CACHE_SALT_CHARS)
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = _f(None, max_len=MAX_ALLOWED_TOKEN_IDS)
    bad_words: list[str] | None = _f(None, max_len=MAX_BAD_WORDS)
    # Keep the last k prompt tokens (-1: the context length), before the length check.
    truncate_prompt_tokens: int | None = _f(None, ge=-1)
    # vLLM's: which end truncate_prompt_tokens cuts, "left" (keeps the last tokens; the
    # default) or "right" (keeps the first)
    truncation_side: str | None = None
    # Logprob tokens as "token_id:<id>" (for tokens that are not valid UTF-8 alone); None:
    # the server's --return-tokens-as-token-ids.
    return_tokens_as_token_ids: bool | None = None
    # Beam search (endpoints/beam_search.py): n beams; the other two act on it only.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool = False
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs.{json, regex, choice, grammar}
    guided_json: Union[str, dict[str, Any], None] = None  # noqa: UP007
    guided_regex: str | None = None
    guided_choice: list[str] | None = _f(None, max_len=4096)
    guided_grammar: str | None = None
    request_id: str | None = _f(None, max_chars=MAX_REQUEST_ID_CHARS)
    # trillm extension: seconds until the request ends with finish_reason "timeout".
    timeout: float | None = _f(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S)
    # vLLM's: a stream's chunks every this many tokens (first and last at once), at least the
    # server's --stream-interval
    stream_interval: int | None = _f(None, ge=1)
    # vLLM's: arguments of custom extensions (strings, numbers or lists of them), the
    # request's SamplingParams.extra_args; custom logits processors read them.
    vllm_xargs: dict[str, Any] | None = _f(None, max_len=256)
    # vLLM's: these ids' logprobs at each sampled position instead of the top ones (needs
    # logprobs); bounded, a client-set cost of every sampled token
    logprob_token_ids: list[int] | None = _f(None, max_len=MAX_LOGPROB_TOKEN_IDS)
    # vLLM's: with --reasoning-parser, the reasoning's tokens before its end is forced (-1: none)
    thinking_token_budget: int | None = _f(None, ge=-1)


@attrs.define(kw_only=True)
class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = _f(max_len=MAX_CHAT_MESSAGES, max_parts=MAX_CHAT_CONTENT_PARTS)
    logprobs: bool = False
    top_logprobs: int | None = _f(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    max_completion_tokens: int | None = _f(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM: the reply is prepended with the last message when that is the assistant's too.
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # The image processor's keywords for this request's images (vLLM's; over the engine's)
    mm_processor_kwargs: dict[str, Any] | None = None
    # The media connectors' options by modality (vLLM's): a video_url's frames (media_io.py)
    media_io_kwargs: dict[str, Any] | None = None
    # Tool calling and reasoning; checked in endpoints/chat.py / parsers.
    tools: list[ChatTool] | None = _f(None, max_len=1024)
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Union[str, NamedToolChoice, None] = None  # noqa: UP007
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    # vLLM's: the template's ``reasoning_effort`` (and ``enable_thinking``: any effort but
    # "none", unless chat_template_kwargs sets it); one of CHAT_REASONING_EFFORTS
    reasoning_effort: str | None = None
    # vLLM's: the tokenizer's special tokens (BOS) on top of those the template writes
    add_special_tokens: bool = False
    documents: list[dict[str, Any]] | None = _f(None, max_len=1024)


@attrs.define(kw_only=True)
class CompletionRequest(_SamplingFields):
    # NOTE: MAX_PROMPTS bounds a list of prompts, never the token ids of one prompt (the
    # context length bounds those).
    # None: prompt_embeds alone (one of the two is required).
    prompt: Union[str, list[str], list[int], list[list[int]], None] = _f(  # noqa: UP007
        None, max_prompts=MAX_PROMPTS
    )
    # --enable-prompt-embeds: base64 torch.save'd [num_tokens, hidden] tensors, served
    # before the prompts (trillm/engine/prompt_embeds.py).
    prompt_embeds: str | list[str] | None = _f(None, max_len=MAX_PROMPTS)
    max_tokens: int | None = _f(16, ge=1)
    echo: bool = False
    logprobs: int | None = _f(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    suffix: str | None = None
    best_of: int | None = _f(None, ge=1)
    add_special_tokens: bool = True


# A request that samples: what the sampling fields' checks and SamplingParams read.
SamplingRequest = ChatCompletionRequest | CompletionRequest


@attrs.define(kw_only=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = _f(
        None, max_len=MAX_CHAT_MESSAGES, max_parts=MAX_CHAT_CONTENT_PARTS
    )
    # None: vLLM's defaults, true for a prompt, false for messages (the template writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: dict[str, Any] | None = None  # the image processor's (vLLM's)
    return_token_strs: bool = False
    tools: list[ChatTool] | None = _f(None, max_len=1024)  # rendered by the chat template


@attrs.define(kw_only=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None
