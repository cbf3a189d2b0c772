"""SamplingParams: vLLM's names and validation rules.

Out-of-range values raise ``ValueError`` naming the parameter, so the HTTP layer can turn them
into a 400 with ``param`` set.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any

from trillm.sampling_errors import SamplingParamsError as SamplingParamsError
from trillm.sampling_extras import logprob_cap, normalise_extras

_GREEDY_EPS = 1e-5

# NOTE: every value crosses the process boundary (msgpack: 64-bit integers) and lands in
# 64-bit torch tensors / C++ ``long long`` fields, or in float32 sampling tensors; values
# outside these ranges are refused here instead of failing a whole step in the worker.
INT64_MIN = -(2**63)
INT64_MAX = 2**63 - 1
INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output, at the end


@dataclass(slots=True)
class StructuredOutputsParams:
    """Structured outputs (vLLM's names; compiled by xgrammar): exactly one of ``json`` (a
    JSON schema, dict or text), ``regex``, ``choice``, ``grammar`` (EBNF, or Lark),
    ``json_object`` or ``structural_tag``. ``disable_any_whitespace``: JSON without free
    whitespace; ``disable_additional_properties``: objects get ``additionalProperties: false``
    unless their schema says otherwise. Checked (kinds, sizes, nesting) when built; whether
    the spec compiles is checked before the engine sees the request."""

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False

    def __post_init__(self) -> None:
        from trillm.structured_output.spec import StructuredOutputError, check_params

        try:
            check_params(self)
        except StructuredOutputError as exc:
            raise SamplingParamsError(exc.param, str(exc)) from None


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 (or -1) disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None  # top-k logprobs per sampled token (0 = sampled token only)
    prompt_logprobs: int | None = None
    prompt_logprobs_temperature: float | None = None  # vLLM's (trillm/sampling_extras.py)
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    # Keep only the last k prompt tokens (-1: max_model_len); applied before the length check.
    truncate_prompt_tokens: int | None = None
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None
    extra_args: dict[str, Any] | None = None
    # vLLM's: these ids' logprobs instead of the top-k, and the reasoning's token budget
    # (trillm/sampling_extras.py)
    logprob_token_ids: list[int] | None = None
    thinking_token_budget: int | None = None
    # Filled by the input processor from the tokenizer, not by users.
    bad_words_token_ids: list[list[int]] | None = None
    # The reasoning parser's [start tag ids, end tag ids] (with thinking_token_budget).
    thinking_tag_ids: list[list[int]] | None = None
    # EOS plus stop_token_ids: what min_tokens suppresses.
    all_stop_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (TypeError, ValueError, OverflowError) as exc:
                raise SamplingParamsError(
                    "logit_bias", "logit_bias keys must be token ids and values numbers."
                ) from exc
        self._verify()
        normalise_extras(self)
        if self.temperature < _GREEDY_EPS:
            # Greedy: the filters are no-ops, normalise them so batching sees one kind.
            self.temperature = 0.0
            self.top_p = 1.0
            self.top_k = 0
            self.min_p = 0.0

    @classmethod
    def from_validated(cls, fields: dict[str, Any]) -> SamplingParams:
        """Rebuilt from the fields of params that were validated and normalised already (the
        IPC codec's decode): no checks run again."""
        params = object.__new__(cls)
        for name, value in fields.items():
            setattr(params, name, value)
        return params

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def _verify(self) -> None:
        self._verify_kinds()
        checks: list[tuple[str, bool, str]] = [
            ("n", self.n >= 1, f"n must be at least 1, got {self.n}."),
            (
                "presence_penalty",
                -2.0 <= self.presence_penalty <= 2.0,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.",
            ),
            (
                "frequency_penalty",
                -2.0 <= self.frequency_penalty <= 2.0,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.",
            ),
            (
                "repetition_penalty",
                self.repetition_penalty > 0.0,
                f"repetition_penalty must be greater than zero, got {self.repetition_penalty}.",
            ),
            (
                "temperature",
                self.temperature >= 0.0,
                f"temperature must be non-negative, got {self.temperature}.",
            ),
            ("top_p", 0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}."),
            (
                "top_k",
                self.top_k >= 0,
                f"top_k must be 0 or -1 (disable), or at least 1, got {self.top_k}.",
            ),
            ("min_p", 0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}."),
            (
                "max_tokens",
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be at least 1, got {self.max_tokens}.",
            ),
            (
                "min_tokens",
                self.min_tokens >= 0,
                f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.",
            ),
            (
                "min_tokens",
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, "
                f"got {self.min_tokens}.",
            ),
            (
                "logprobs",
                self.logprobs is None or self.logprobs >= -1,
                f"logprobs must be non-negative or -1 (the whole vocabulary), got {self.logprobs}.",
            ),
            (
                "prompt_logprobs",
                self.prompt_logprobs is None or self.prompt_logprobs >= -1,
                "prompt_logprobs must be non-negative or -1 (the whole vocabulary), got "
                f"{self.prompt_logprobs}.",
            ),
            (
                "truncate_prompt_tokens",
                self.truncate_prompt_tokens is None or self.truncate_prompt_tokens >= -1,
                "truncate_prompt_tokens must be -1 (the context length) or at least 0, got "
                f"{self.truncate_prompt_tokens}.",
            ),
        ]
        for param, ok, message in checks:
            if not ok:
                raise SamplingParamsError(param, message)
        if self.stop is not None and not all(isinstance(s, str) and s for s in self.stop):
            raise SamplingParamsError("stop", "stop must be a list of non-empty strings.")
        if self.stop_token_ids is not None and not all(
            isinstance(t, int) and t >= 0 for t in self.stop_token_ids
        ):
            raise SamplingParamsError(
                "stop_token_ids", "stop_token_ids must be a list of non-negative integers."
            )
        if self.allowed_token_ids is not None and not self.allowed_token_ids:
            raise SamplingParamsError("allowed_token_ids", "allowed_token_ids must not be empty.")
        if self.logit_bias is not None:
            for value in self.logit_bias.values():
                if not -100.0 <= value <= 100.0:
                    raise SamplingParamsError(
                        "logit_bias", f"logit_bias values must be in [-100, 100], got {value}."
                    )

    def _verify_kinds(self) -> None:
        """Types and representable ranges: integers fit 64 (or 32) bits, floats are finite
        float32 values. Runs before the range checks so those compare plain numbers."""
        for name, high in _INT_FIELDS:
            value = getattr(self, name)
            if value is None and name in _OPTIONAL:
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}.")
            if not INT64_MIN <= value <= high:
                raise SamplingParamsError(
                    name, f"{name} must be an integer in [{INT64_MIN}, {high}], got {value}."
                )
        for name in _FLOAT_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise SamplingParamsError(name, f"{name} must be a number, got {value!r}.")
            if not math.isfinite(value) or abs(value) > FLOAT32_MAX:
                raise SamplingParamsError(
                    name, f"{name} must be a finite number within float32 range, got {value}."
                )
        for name in ("stop_token_ids", "allowed_token_ids"):
            ids = getattr(self, name)
            if ids is not None and not all(
                isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= INT64_MAX for t in ids
            ):
                raise SamplingParamsError(
                    name, f"{name} must be a list of non-negative 64-bit integers."
                )
        if self.logit_bias is not None and not all(
            0 <= k <= INT64_MAX and math.isfinite(v) for k, v in self.logit_bias.items()
        ):
            raise SamplingParamsError(
                "logit_bias", "logit_bias keys must be token ids and values finite numbers."
            )
        if self.extra_args is not None:
            _check_plain_data(self.extra_args, "extra_args")

    def verify_vocab(self, vocab_size: int, max_logprobs: int) -> None:
        """Checks that need the model: token ids in range, logprob counts under the cap; a
        count of -1 becomes the vocabulary size (vLLM's, as is max_logprobs -1: no cap)."""
        for name, ids in (
            ("allowed_token_ids", self.allowed_token_ids),
            ("stop_token_ids", self.stop_token_ids),
            ("logit_bias", list(self.logit_bias) if self.logit_bias else None),
            ("logprob_token_ids", self.logprob_token_ids),
        ):
            outside = [t for t in ids or () if not 0 <= t < vocab_size]
            if outside:
                # The ids themselves, as vLLM's message names them (its tests match them).
                raise SamplingParamsError(
                    name,
                    f"{name} contains token ids outside the vocabulary [0, {vocab_size}): "
                    f"{', '.join(map(str, outside[:8]))}.",
                )
        cap = logprob_cap(max_logprobs, vocab_size)
        for name in ("logprobs", "prompt_logprobs"):
            if (value := getattr(self, name)) == -1:
                setattr(self, name, value := vocab_size)
            # (logprobs counting logprob_token_ids is bounded by MAX_LOGPROB_TOKEN_IDS)
            chosen = name == "logprobs" and self.logprob_token_ids
            if value is not None and value > cap and not chosen:
                raise SamplingParamsError(
                    name, f"Requested {name}={value}, more than max_logprobs={cap}."
                )

    def clone(self) -> SamplingParams:
        """A copy to change; ``allowed_token_ids`` (never changed) is shared, not copied per
        sample of ``n`` (2,000,000 ids, n=128: 264 s of deep copies on the event loop)."""
        import copy

        return copy.deepcopy(self, {id(self.allowed_token_ids): self.allowed_token_ids})


# (name, highest value): integer fields (the range checks in _verify refine the lowest).
_INT_FIELDS = (
    ("n", INT32_MAX),
    ("top_k", INT64_MAX),
    ("seed", INT64_MAX),
    ("max_tokens", INT64_MAX),
    ("min_tokens", INT32_MAX),
    ("logprobs", INT32_MAX),
    ("prompt_logprobs", INT32_MAX),
    ("truncate_prompt_tokens", INT64_MAX),
)
_OPTIONAL = frozenset(
    {"seed", "max_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens"}
)
_FLOAT_FIELDS = (
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
    "temperature",
    "top_p",
    "min_p",
)
_MAX_DEPTH = 32


def _check_plain_data(value: Any, name: str, depth: int = 0) -> None:
    """``value`` is JSON-like data (what the IPC codec carries): None, bools, 64-bit ints,
    finite floats, strings, lists and string-keyed dicts, nested at most _MAX_DEPTH deep."""
    if depth > _MAX_DEPTH:
        raise SamplingParamsError(name, f"{name} is nested deeper than {_MAX_DEPTH} levels.")
    if value is None or isinstance(value, (bool, str)):
        return
    if isinstance(value, int):
        if not INT64_MIN <= value <= INT64_MAX:
            raise SamplingParamsError(name, f"{name} holds an integer outside 64 bits: {value}.")
        return
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SamplingParamsError(name, f"{name} holds a non-finite number: {value}.")
        return
    if isinstance(value, (list, tuple)):
        for item in value:
            _check_plain_data(item, name, depth + 1)
        return
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, str):
                raise SamplingParamsError(name, f"{name} keys must be strings, got {key!r}.")
            _check_plain_data(item, name, depth + 1)
        return
    raise SamplingParamsError(
        name, f"{name} must hold plain data (JSON-like), got {type(value).__name__}."
    )


@dataclass(slots=True)
class BeamSearchParams:
    """vLLM's beam search parameters (``LLM.beam_search``; ``use_beam_search`` over HTTP),
    searched as transformers' ``generate(num_beams=beam_width, do_sample=False)`` does
    (``trillm/engine/beam_search.py``). ``length_penalty``: a finished beam scores its
    cumulative logprob / generated length ** length_penalty. ``early_stopping``
    (transformers'): True ends once ``beam_width`` beams finished; False once no running beam
    can beat the worst finished one at its current length; ``"never"`` at the longest length
    it could still reach. ``stop``: strings that finish a beam, as EOS does. Beam search is
    deterministic, so ``temperature`` must be 0."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    stop: list[str] | None = None
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        checks: list[tuple[str, bool, str]] = [
            ("beam_width", _is_int(self.beam_width) and self.beam_width >= 1, "at least 1"),
            ("max_tokens", _is_int(self.max_tokens) and self.max_tokens >= 1, "at least 1"),
            ("temperature", self.temperature == 0, "0 (beam search does not sample)"),
            # NOTE: a length ** penalty must stay a finite, non-zero float for any length.
            ("length_penalty", _is_penalty(self.length_penalty), "a number in [-20, 20]"),
            (
                "early_stopping",
                isinstance(self.early_stopping, bool) or self.early_stopping == "never",
                'a bool or "never"',
            ),
            ("stop", all(isinstance(s, str) and s for s in self.stop or ()), "non-empty strings"),
        ]
        for name, ok, rule in checks:
            if not ok:
                value = getattr(self, name)
                raise SamplingParamsError(name, f"{name} must be {rule}, got {value!r}.")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value <= INT32_MAX


def _is_penalty(value: Any) -> bool:
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return number and math.isfinite(value) and -20 <= value <= 20
