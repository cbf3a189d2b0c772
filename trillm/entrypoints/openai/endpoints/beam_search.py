"""``use_beam_search`` on /v1/completions and /v1/chat/completions, with vLLM's fields: ``n``
is the beam width (all ``n`` beams come back as the choices, best first), ``length_penalty``,
``early_stopping``, ``stop``, ``include_stop_str_in_output``, ``ignore_eos``, ``max_tokens``
(the search itself: ``trillm/engine/beam_request.py``, run by ``generation.start_generation``).

Beam search does not sample: vLLM ignores the sampling fields with it, here each one set is
refused naming it, as are logprobs (a beam's candidates are not the answer's logprobs) and
structured outputs. ``length_penalty`` and ``early_stopping`` only act on beam search, so
without it they are refused unless left at their defaults.

Cost: the request is checked and admitted as ``n`` sequences of ``max_tokens`` each (the
same budgets as sampling ``n``), which is what the search holds at most at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from trillm.engine.preprocess import PreparedPrompt
from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.protocol import SamplingRequest
from trillm.sampling_params import BeamSearchParams, SamplingParamsError


def _set(value: Any) -> bool:
    return value is not None


def _truthy(value: Any) -> bool:
    return bool(value)


def _not(default: Any) -> Callable[[Any], bool]:
    return lambda value: value is not None and value != default


# Request fields beam search cannot honour, and when a request sets them.
_REFUSED: tuple[tuple[str, Callable[[Any], bool]], ...] = (
    ("top_p", _not(1.0)),
    ("top_k", lambda v: v is not None and v not in (0, -1)),
    ("min_p", _not(0.0)),
    ("presence_penalty", _not(0.0)),
    ("frequency_penalty", _not(0.0)),
    ("repetition_penalty", _not(1.0)),
    ("logit_bias", _truthy),
    ("stop_token_ids", _truthy),
    ("min_tokens", _truthy),
    ("allowed_token_ids", _set),
    ("bad_words", _truthy),
    # the beams' texts are decoded whole, by the tokenizer, which spaces special tokens its way
    ("spaces_between_special_tokens", lambda v: v is False),
    ("prompt_logprobs", _set),
    ("structured_outputs", _set),
    ("guided_json", _set),
    ("guided_regex", _set),
    ("guided_choice", _set),
    ("guided_grammar", _set),
    ("response_format", lambda v: v is not None and v.type != "text"),
    ("thinking_token_budget", lambda v: v is not None and v != -1),
    ("logprob_token_ids", _truthy),  # (before logprobs, which it needs: named first)
    # completions: an int; chat: true, or top_logprobs
    ("logprobs", lambda v: v is not None and v is not False),
    ("top_logprobs", _set),
    # the beams' one-token requests carry no extra_args (nor do vLLM's): no custom processor
    ("vllm_xargs", _truthy),
)


def check_beam_fields(req: SamplingRequest) -> None:
    """Beam search's own fields without it, or fields it cannot honour with it: a 400
    naming the field."""
    if not req.use_beam_search:
        for name, default in (("length_penalty", 1.0), ("early_stopping", False)):
            if getattr(req, name) != default:
                raise BadRequestError(
                    f"'{name}' applies to beam search only; set 'use_beam_search': true.", name
                )
        return
    for name, is_set in _REFUSED:
        if is_set(getattr(req, name, None)):
            raise BadRequestError(
                f"'{name}' cannot be combined with 'use_beam_search': beam search does not "
                "sample and returns its beams' texts only.",
                name,
            )


def beam_params(req: SamplingRequest, jobs: list[PreparedPrompt]) -> BeamSearchParams | None:
    """The request's BeamSearchParams (None without ``use_beam_search``); each prompt's
    ``max_tokens`` as its preparation resolved it (the longest here, each kept per prompt by
    the search)."""
    if not req.use_beam_search:
        return None
    if jobs[0].params.structured_outputs is not None:  # a required / named tool_choice
        raise BadRequestError(
            "'tool_choice' that forces a tool call cannot be combined with 'use_beam_search'.",
            "tool_choice",
        )
    stop = req.stop
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max(job.params.max_tokens or 1 for job in jobs),
            ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
            early_stopping=req.early_stopping,
            stop=[stop] if isinstance(stop, str) else stop,
            skip_special_tokens=jobs[0].params.skip_special_tokens,
        )
    except SamplingParamsError as exc:
        raise BadRequestError(str(exc), exc.param) from exc
