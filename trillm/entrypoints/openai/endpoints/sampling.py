"""SamplingParams from a chat or completion request: the model's generation_config gives
the defaults, the request overrides them, and out-of-range values become 400s naming the field.
What depends on the prompt or the model's limits (context length and max_tokens, vocabulary,
logprob cap, KV cache) is checked by the engine's preprocessor (``trillm/engine/preprocess.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

from trillm.entrypoints.openai.endpoints.beam_search import check_beam_fields
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import (
    MAX_STOP_STRING_LEN,
    ResponseFormat,
    SamplingRequest,
)
from trillm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingParamsError,
    StructuredOutputsParams,
)

if TYPE_CHECKING:
    from trillm.entrypoints.openai.endpoints.base import ServerState

# generation_config.json keys that become request defaults (vLLM's list).
_GENERATION_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def build_sampling_params(
    state: ServerState,
    req: SamplingRequest,
    *,
    max_tokens: int | None,
    logprobs: int | None,
    n: int | None = None,
) -> SamplingParams:
    """The request's sampling fields with the model's generation_config as defaults;
    ``max_tokens`` None: resolved from the context by the preprocessor."""
    defaults = {
        k: v
        for k, v in (state.model_config.generation_config or {}).items()
        if k in _GENERATION_DEFAULTS and v is not None
    }

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        return value if value is not None else defaults.get(name, fallback)

    _check_request(req)
    kwargs = dict(
        n=n if n is not None else req.n,
        temperature=pick("temperature", 1.0),
        top_p=pick("top_p", 1.0),
        top_k=pick("top_k", 0),
        min_p=pick("min_p", 0.0),
        repetition_penalty=pick("repetition_penalty", 1.0),
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        seed=req.seed,
        stop=[req.stop] if isinstance(req.stop, str) else req.stop,
        stop_token_ids=req.stop_token_ids,
        ignore_eos=req.ignore_eos,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        # logprob_token_ids takes the place of the top logprobs (vLLM's precedence)
        logprobs=None if req.logprob_token_ids else logprobs,
        logprob_token_ids=req.logprob_token_ids or None,
        thinking_token_budget=req.thinking_token_budget,
        prompt_logprobs=req.prompt_logprobs,
        prompt_logprobs_temperature=req.prompt_logprobs_temperature,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        logit_bias=_logit_bias(req.logit_bias),
        allowed_token_ids=req.allowed_token_ids,
        bad_words=req.bad_words,
        truncate_prompt_tokens=req.truncate_prompt_tokens,
        output_kind=RequestOutputKind.DELTA,
        structured_outputs=_structured_outputs(req),
        extra_args=_xargs(req.vllm_xargs),
    )
    try:
        return SamplingParams(**kwargs)
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), exc.param) from exc


def _check_request(req: SamplingRequest) -> None:
    """Request-level rules of both endpoints that no single field's range expresses."""
    if req.stream_options is not None and not req.stream:
        raise BadRequestError(
            "'stream_options' can only be set when 'stream' is true.", "stream_options"
        )
    check_beam_fields(req)
    if req.logprob_token_ids and (req.logprobs is None or req.logprobs is False):
        raise BadRequestError(
            "'logprob_token_ids' needs 'logprobs' set (chat: true): the ids' logprobs are "
            "returned in its place.",
            "logprob_token_ids",
        )
    stop = req.stop
    _check_strings("stop", [stop] if isinstance(stop, str) else stop or [])
    _check_strings("bad_words", req.bad_words or [])


def _check_strings(param: str, strings: list[str]) -> None:
    for s in strings:
        if not s:
            raise BadRequestError(f"'{param}' strings must not be empty.", param)
        if len(s) > MAX_STOP_STRING_LEN:
            raise BadRequestError(
                f"'{param}' strings are limited to {MAX_STOP_STRING_LEN} characters, got {len(s)}.",
                param,
            )


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if not bias:
        return None
    # Every key that is no token id is named at once, as vLLM does.
    bad = [key for key in bias if not _is_int(key)]
    if bad:
        raise BadRequestError(
            f"'logit_bias' keys must be token ids, got {', '.join(map(repr, bad[:8]))}.",
            "logit_bias",
        )
    return {int(key): value for key, value in bias.items()}


def _is_int(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


_XARG_SCALARS = (str, int, float)  # bool is an int, as in vLLM's schema
# The values of one request's vllm_xargs (a list counts its entries) and their strings'
# characters: each sample of n carries a copy; 1,000,000 entries with n=64 held the event loop
# 53 s, one 8 MB string with n=128 20 s, and a request beside it as long.
MAX_XARGS_VALUES = 4096
MAX_XARGS_CHARS = 65536


def _xargs(xargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """``vllm_xargs`` -> ``extra_args``: values are strings, numbers or lists of them."""
    if not xargs:
        return None
    values = sum(len(value) if isinstance(value, list) else 1 for value in xargs.values())
    if values > MAX_XARGS_VALUES:
        raise BadRequestError(
            f"'vllm_xargs' holds {values} values (a list counts its entries), more than the "
            f"limit of {MAX_XARGS_VALUES}.",
            "vllm_xargs",
        )
    chars = sum(map(len, xargs)) + sum(
        len(item)
        for value in xargs.values()
        for item in (value if isinstance(value, list) else [value])
        if isinstance(item, str)
    )
    if chars > MAX_XARGS_CHARS:
        raise BadRequestError(
            f"'vllm_xargs' holds {chars} characters in its keys and strings, more than the "
            f"limit of {MAX_XARGS_CHARS}.",
            "vllm_xargs",
        )
    for key, value in xargs.items():
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, _XARG_SCALARS) for item in items):
            raise BadRequestError(
                f"'vllm_xargs' values must be strings, numbers or lists of them; {key!r} "
                f"is {value!r}.",
                "vllm_xargs",
            )
    return dict(xargs)


_SO_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")
# vLLM's older request fields, aliases of structured_outputs.<kind>
_GUIDED = (
    ("guided_json", "json"),
    ("guided_regex", "regex"),
    ("guided_choice", "choice"),
    ("guided_grammar", "grammar"),
)


def _structured_outputs(req: SamplingRequest) -> StructuredOutputsParams | None:
    """``structured_outputs``, the ``guided_*`` aliases and ``response_format`` -> one
    ``StructuredOutputsParams`` (as vLLM, ``response_format`` fills ``structured_outputs``'
    kind, so the options there still apply). More than one kind is a 400 naming them."""
    so = req.structured_outputs
    fields = attrs.asdict(so, recurse=False) if so is not None else {}
    chosen = [
        (f"structured_outputs.{k}", k, fields[k]) for k in _SO_KINDS if fields.get(k) is not None
    ]
    for name, kind in _GUIDED:
        value = getattr(req, name, None)
        if value is not None:
            chosen.append((name, kind, value))
    from_format = _response_format_kind(req.response_format)
    if from_format is not None:
        chosen.append(from_format)
    if so is None and not chosen:
        return None
    if len(chosen) != 1:
        raise BadRequestError(
            "Structured outputs must set exactly one of structured_outputs."
            f"{{{', '.join(_SO_KINDS)}}} (or response_format / guided_*); got "
            f"{', '.join(name for name, _, _ in chosen) or 'none'}.",
            "structured_outputs" if so is not None or not chosen else chosen[1][0],
        )
    name, kind, value = chosen[0]
    try:
        return StructuredOutputsParams(
            **{kind: value},
            disable_any_whitespace=bool(fields.get("disable_any_whitespace")),
            disable_additional_properties=bool(fields.get("disable_additional_properties")),
        )
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), name) from exc


def _response_format_kind(fmt: ResponseFormat | None) -> tuple[str, str, Any] | None:
    """``response_format`` -> (param, kind, value), None for ``text``."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return ("response_format", "json_object", True)
    if fmt.type == "structural_tag":
        if fmt.format is not None:
            return (
                "response_format.format",
                "structural_tag",
                {"type": "structural_tag", "format": fmt.format},
            )
        if fmt.structures is None:
            raise BadRequestError(
                "'response_format' of type 'structural_tag' needs 'format' or 'structures'.",
                "response_format",
            )
        tag = {"structures": fmt.structures, "triggers": fmt.triggers or []}
        return ("response_format.structures", "structural_tag", tag)
    if fmt.json_schema is None or fmt.json_schema.schema is None:
        raise BadRequestError(
            "'response_format.json_schema.schema' is required when type is 'json_schema'.",
            "response_format.json_schema",
        )
    return ("response_format.json_schema.schema", "json", fmt.json_schema.schema)


def truncate_right(req: SamplingRequest, ids: list[int], max_model_len: int) -> list[int] | None:
    """vLLM's ``truncation_side``: "right" keeps the first ``truncate_prompt_tokens`` ids (then
    the engine's own truncation, from the left, keeps them all); None (vLLM's default) and
    "left" leave it to the engine, which keeps the last ones: None is returned."""
    side = req.truncation_side
    if side not in (None, "left", "right"):
        raise BadRequestError(
            f"'truncation_side' must be 'left' or 'right', got {side!r}.", "truncation_side"
        )
    keep = req.truncate_prompt_tokens
    if side != "right" or keep is None:
        return None
    return ids[: max_model_len if keep == -1 else keep]
