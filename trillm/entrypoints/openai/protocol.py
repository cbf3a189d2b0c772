"""Request schemas (attrs classes) and their strict structuring from JSON.

Unknown fields are accepted and ignored (OpenAI clients send extras); known fields are checked
for type and range, and the first bad one is reported with its path as ``param``
(``temperature``, ``messages[1].content``). Ranges live in each field's metadata
(``ge``/``gt``/``le``/``max_len``/``max_prompts``) so the OpenAPI schema (``openapi.py``) is
generated from the same declaration the validator enforces.

Every integer must fit 64 bits and every number be a finite float32 value, whatever the field:
what a client sends crosses the process boundary and lands in 64-bit and float32 tensors.
Sizes are checked before the items are looked at, so an oversized list costs O(1).
"""

from __future__ import annotations

import contextvars
import logging
import types
import typing
from typing import Any, Literal, Union

import attrs
import trio

from trillm.entrypoints.openai.errors import BadRequestError
from trillm.sampling_params import FLOAT32_MAX, INT64_MAX, INT64_MIN

logger = logging.getLogger(__name__)

MAX_N = 128
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 256
MAX_PROMPTS = 1024
MAX_BAD_WORDS = 256
MAX_REQUEST_TIMEOUT_S = 86_400.0  # a request's ``timeout``: at most a day
# A client's request_id travels with every engine step (scheduler, worker messages, every
# output): three 1 MB ids slowed a 200-token request beside them from 0.3 s to 14 s.
MAX_REQUEST_ID_CHARS = 256


def _f(default: Any = attrs.NOTHING, **limits: Any) -> Any:
    """A field with range limits in its metadata (checked by ``structure``)."""
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
class TextPart:
    type: str
    text: str | None = None


# ---------------------------------------------------------------- tools (issue 12)


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
    prompt_logprobs: int | None = _f(None, ge=0)
    priority: int = 0
    cache_salt: str | None = None
    return_token_ids: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = _f(None, max_len=MAX_BAD_WORDS)
    # Keep the last k prompt tokens (-1: the context length), before the length check.
    truncate_prompt_tokens: int | None = _f(None, ge=-1)
    # Logprob tokens as "token_id:<id>" (for tokens that are not valid UTF-8 alone).
    return_tokens_as_token_ids: bool = False
    use_beam_search: bool = False  # refused when true: no beam search here
    structured_outputs: StructuredOutputs | None = None
    # vLLM's older names for structured_outputs.{json, regex, choice, grammar}
    guided_json: Union[str, dict[str, Any], None] = None  # noqa: UP007
    guided_regex: str | None = None
    guided_choice: list[str] | None = _f(None, max_len=4096)
    guided_grammar: str | None = None
    request_id: str | None = _f(None, max_chars=MAX_REQUEST_ID_CHARS)
    # trillm extension: seconds until the request ends with finish_reason "timeout".
    timeout: float | None = _f(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S)


@attrs.define(kw_only=True)
class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = _f(max_len=100_000)
    logprobs: bool = False
    top_logprobs: int | None = _f(None, ge=0)
    max_completion_tokens: int | None = _f(None, ge=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM: the reply is prepended with the last message when that is the assistant's too.
    echo: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Tool calling and reasoning (issue 12); checked in serving_chat / parsers.
    tools: list[ChatTool] | None = _f(None, max_len=1024)
    # "none" | "auto" | "required" | {"type": "function", "function": {"name": ...}}
    tool_choice: Union[str, NamedToolChoice, None] = None  # noqa: UP007
    parallel_tool_calls: bool | None = True
    include_reasoning: bool = True
    documents: list[dict[str, Any]] | None = _f(None, max_len=1024)


@attrs.define(kw_only=True)
class CompletionRequest(_SamplingFields):
    # NOTE: MAX_PROMPTS bounds a list of prompts, never the token ids of one prompt (the
    # context length bounds those).
    prompt: Union[str, list[str], list[int], list[list[int]]] = _f(max_prompts=MAX_PROMPTS)  # noqa: UP007
    max_tokens: int | None = _f(16, ge=1)
    echo: bool = False
    logprobs: int | None = _f(None, ge=0)
    suffix: str | None = None
    best_of: int | None = _f(None, ge=1)
    add_special_tokens: bool = True


@attrs.define(kw_only=True)
class TokenizeRequest:
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    # None: vLLM's defaults, true for a prompt, false for messages (the template writes them).
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


@attrs.define(kw_only=True)
class DetokenizeRequest:
    tokens: list[int]
    model: str | None = None


# ---------------------------------------------------------------- structuring


def structure(cls: type[Any], data: Any) -> Any:
    """Build ``cls`` from decoded JSON, or raise BadRequestError naming the first bad field.

    Unknown fields are ignored with one warning line naming them all (vLLM's behaviour)."""
    token = _UNKNOWN.set([])
    try:
        result = _structure_attrs(cls, data, "")
        unknown = _UNKNOWN.get()
    finally:
        _UNKNOWN.reset(token)
    if unknown:
        logger.warning(
            "The following fields were present in the request but ignored: %s",
            ", ".join(unknown[:_MAX_LOGGED_UNKNOWN]),
        )
    return result


# Bodies at least this large (or of unknown length) are structured on a worker thread:
# structuring costs ~20 us per chat message or content part, and on the event loop that is
# every other request's stall (400,000 text parts in a 12 MB body: 8 s).
STRUCTURE_OFF_LOOP_BYTES = 256 * 1024


async def structure_body(cls: type[Any], data: Any, body_bytes: int | None) -> Any:
    """``structure``, off the event loop for a large body (``body_bytes``: its length)."""
    if body_bytes is not None and body_bytes < STRUCTURE_OFF_LOOP_BYTES:
        return structure(cls, data)
    return await trio.to_thread.run_sync(structure, cls, data)


# Paths of the unknown fields met while structuring one request (see ``structure``).
_UNKNOWN: contextvars.ContextVar[list[str]] = contextvars.ContextVar("unknown_fields")
_MAX_LOGGED_UNKNOWN = 32


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type[Any]) -> dict[str, Any]:
    hints = _HINTS.get(cls)
    if hints is None:
        hints = _HINTS[cls] = typing.get_type_hints(cls)
    return hints


def _structure_attrs(cls: type[Any], data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        where = f"'{path}' " if path else "The request body "
        raise BadRequestError(f"{where}must be a JSON object.", path or None)
    hints = _hints(cls)
    if not data.keys() <= hints.keys():
        extra = _UNKNOWN.get(None)
        if extra is not None and len(extra) < _MAX_LOGGED_UNKNOWN:
            extra.extend(f"{path}.{k}" if path else k for k in data if k not in hints)
    kwargs: dict[str, Any] = {}
    for field in attrs.fields(cls):
        name = field.name
        fpath = f"{path}.{name}" if path else name
        if name not in data:
            if field.default is attrs.NOTHING:
                raise BadRequestError(f"Field required: '{fpath}'.", fpath)
            continue
        raw = data[name]
        _check_size(raw, field.metadata, fpath)
        value = _structure(raw, hints[name], fpath)
        _check_limits(value, field.metadata, fpath)
        kwargs[name] = value
    return cls(**kwargs)


def _structure(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if origin is Union or origin is types.UnionType:
        return _structure_union(value, typing.get_args(tp), path)
    if origin is Literal:
        allowed = typing.get_args(tp)
        if value not in allowed:
            raise BadRequestError(
                f"'{path}' must be one of {', '.join(map(repr, allowed))}, got {value!r}.", path
            )
        return value
    if origin is list:
        if not isinstance(value, list):
            raise _type_error(path, "an array", value)
        (item_tp,) = typing.get_args(tp)
        if item_tp is int and _all_int64(value):
            return list(value)  # token ids: the common large list, checked at C speed
        return [_structure(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise _type_error(path, "an object", value)
        _, val_tp = typing.get_args(tp)
        return {k: _structure(v, val_tp, f"{path}.{k}") for k, v in value.items()}
    if attrs.has(tp):
        return _structure_attrs(tp, value, path)
    return _structure_scalar(value, tp, path)


def _structure_union(value: Any, options: tuple[Any, ...], path: str) -> Any:
    if value is None:
        if type(None) in options:
            return None
        raise BadRequestError(f"'{path}' must not be null.", path)
    candidates = [o for o in options if o is not type(None)]
    first_error: BadRequestError | None = None
    for option in candidates:
        if not _shallow_match(value, option):
            continue
        try:
            return _structure(value, option, path)
        except BadRequestError as exc:
            first_error = first_error or exc
    if first_error is not None:
        raise first_error
    expected = " or ".join(_describe(o) for o in candidates)
    raise _type_error(path, expected, value)


def _shallow_match(value: Any, tp: Any) -> bool:
    """Whether ``value``'s JSON kind fits ``tp`` at the top level (picks a union branch)."""
    origin = typing.get_origin(tp)
    if origin is list:
        if not isinstance(value, list):
            return False
        (item_tp,) = typing.get_args(tp)
        return not value or _shallow_match(value[0], item_tp)
    if origin is dict or attrs.has(tp):
        return isinstance(value, dict)
    if tp is Any:
        return True
    try:
        _structure_scalar(value, tp, "")
    except BadRequestError:
        return False
    return True


def _structure_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise _type_error(path, "a boolean", value)
    if tp is int:
        # NOTE: JSON integers past 64 bits arrive as floats (rounded: -2**63 - 1 becomes
        # -2**63); a float can only stand for an integer strictly inside the int64 range.
        if isinstance(value, float) and value.is_integer() and -(2.0**63) < value < 2.0**63:
            value = int(value)
        elif isinstance(value, float) and value.is_integer():
            raise BadRequestError(f"'{path}' must fit in 64 bits, got {value}.", path)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise BadRequestError(f"'{path}' must fit in 64 bits, got {value}.", path)
            return value
        raise _type_error(path, "an integer", value)
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not -FLOAT32_MAX <= value <= FLOAT32_MAX:  # NaN fails both comparisons
                raise BadRequestError(
                    f"'{path}' must be a finite number within float32 range, got {value}.", path
                )
            return float(value)
        raise _type_error(path, "a number", value)
    if tp is str:
        if isinstance(value, str):
            return value
        raise _type_error(path, "a string", value)
    raise TypeError(f"protocol: no structuring rule for {tp!r}")  # a bug in this module


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        return f"an array of {_describe(typing.get_args(tp)[0]).removeprefix('an ').removeprefix('a ')}s"
    if origin is dict or attrs.has(tp):
        return "an object"
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string"}.get(
        tp, str(tp)
    )


def _type_error(path: str, expected: str, value: Any) -> BadRequestError:
    shown = repr(value)
    if len(shown) > 40:
        shown = shown[:37] + "..."
    return BadRequestError(f"'{path}' must be {expected}, got {shown}.", path)


def _all_int64(values: list[Any]) -> bool:
    return all(type(v) is int for v in values) and (
        not values or (INT64_MIN <= min(values) and max(values) <= INT64_MAX)
    )


def _check_size(value: Any, limits: Any, path: str) -> None:
    """Entry-count limits, checked on the raw JSON before any entry is structured."""
    if limits and isinstance(value, str) and "max_chars" in limits:
        if len(value) > limits["max_chars"]:
            raise BadRequestError(
                f"'{path}' has {len(value)} characters, more than the limit of "
                f"{limits['max_chars']}.",
                path,
            )
        return
    if not limits or not isinstance(value, (list, dict)):
        return
    limit = limits.get("max_len")
    if limit is None and "max_prompts" in limits and value and not isinstance(value[0], int):
        limit = limits["max_prompts"]  # a list of prompts (a list of ints is one prompt)
    if limit is not None and len(value) > limit:
        raise BadRequestError(
            f"'{path}' has {len(value)} entries, more than the limit of {limit}.", path
        )


def _check_limits(value: Any, limits: Any, path: str) -> None:
    if value is None or not limits:
        return
    if isinstance(value, (list, dict, str)):
        return
    if "ge" in limits and value < limits["ge"]:
        raise BadRequestError(f"'{path}' must be >= {limits['ge']}, got {value}.", path)
    if "gt" in limits and value <= limits["gt"]:
        raise BadRequestError(f"'{path}' must be > {limits['gt']}, got {value}.", path)
    if "le" in limits and value > limits["le"]:
        raise BadRequestError(f"'{path}' must be <= {limits['le']}, got {value}.", path)
