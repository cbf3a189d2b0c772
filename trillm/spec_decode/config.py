"""``speculative_config`` (vLLM's engine argument and JSON shape) -> ``SpeculativeConfig``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Drafts per step past this cost more forward rows than they can save on any workload.
MAX_SPECULATIVE_TOKENS = 32
_NGRAM_KEYS = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"}
_MODEL_KEYS = {"method", "model", "num_speculative_tokens"}
_NOT_IMPLEMENTED = ("medusa", "mlp_speculator")
# Methods whose "model" is a folder the worker runs beside the target (a draft, an EAGLE head,
# the target's own MTP layers).
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# vLLM's names for the MTP layers a checkpoint ships, which it runs as method "mtp".
_MTP_ALIASES = ("mtp", "deepseek_mtp")
_DEFAULT_LOOKUP = 5  # vLLM's default n-gram length when neither bound is given


class DraftModelError(ValueError):
    """The draft model or EAGLE head cannot serve this target (vocabulary, fields,
    parallelism)."""


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str  # "ngram" | "draft_model" | "eagle" | "eagle3" | "mtp"
    num_speculative_tokens: int  # k: drafts proposed per request and step
    prompt_lookup_min: int = 0  # ngram: shortest suffix n-gram that is looked up
    prompt_lookup_max: int = 0  # ngram: longest one (tried first)
    # draft_model: the draft's folder (or .gguf), same tokenizer; eagle / eagle3: the head's folder;
    # mtp: None (the target's own folder) or that folder
    model: str | None = None


def _positive_int(spec: dict[str, Any], key: str) -> int | None:
    value = spec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"speculative_config: {key} must be an integer >= 1, got {value!r}.")
    return value


def parse_speculative_config(value: str | dict[str, Any] | None) -> SpeculativeConfig | None:
    """A JSON string or dict -> SpeculativeConfig; ValueError naming what is wrong."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative_config is not valid JSON: {exc}.") from None
    if not isinstance(value, dict):
        raise ValueError(f"speculative_config must be a JSON object, got {value!r}.")
    method = value.get("method")
    if method is None and "model" in value:
        # As vLLM: a model without a method is a draft model ("ngram" names the method).
        method = "ngram" if value["model"] in ("ngram", "[ngram]") else "draft_model"
        value = {k: v for k, v in value.items() if not (k == "model" and method == "ngram")}
    if method in _NOT_IMPLEMENTED:
        raise ValueError(
            f"speculative_config: method {method!r} is not implemented yet; use "
            '{"method": "ngram", ...}, {"method": "draft_model", "model": ...} or '
            '{"method": "eagle" | "eagle3", "model": ...} or {"method": "mtp", ...}.'
        )
    if method in _MTP_ALIASES:
        method = "mtp"
    if method != "ngram" and method not in MODEL_METHODS:
        raise ValueError(
            f"speculative_config: unknown method {method!r}; supported: ngram, "
            f"{', '.join(MODEL_METHODS)}."
        )
    allowed = _NGRAM_KEYS if method == "ngram" else _MODEL_KEYS
    unknown = sorted(set(value) - allowed)
    if unknown:
        raise ValueError(
            f"speculative_config: key(s) {', '.join(unknown)} are not supported with {method} "
            f"(supported: {', '.join(sorted(allowed))})."
        )
    k = _positive_int(value, "num_speculative_tokens")
    if k is None and method == "mtp":
        # As vLLM: the model's MTP layer count, 1 for every model mtp_config.py accepts.
        k = 1
    if k is None:
        raise ValueError("speculative_config: num_speculative_tokens is required.")
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config: num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, "
            f"got {k}."
        )
    if method == "mtp":  # as vLLM: the layers are the target's own, "model" may be left out
        model = value.get("model")
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f'speculative_config: mtp "model" must be a folder, got {model!r}.')
        return SpeculativeConfig(method, k, model=model)
    if method in MODEL_METHODS:
        model = value.get("model")
        if not isinstance(model, str) or not model:
            what = (
                "the draft model's folder or .gguf file"
                if method == "draft_model"
                else "the EAGLE head's folder"
            )
            raise ValueError(f'speculative_config: {method} needs "model": {what}.')
        return SpeculativeConfig(method, k, model=model)
    lo = _positive_int(value, "prompt_lookup_min")
    hi = _positive_int(value, "prompt_lookup_max")
    # As vLLM: one bound given sets the other; neither gives 5..5.
    lo, hi = (lo or hi or _DEFAULT_LOOKUP), (hi or lo or _DEFAULT_LOOKUP)
    if lo > hi:
        raise ValueError(
            f"speculative_config: prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})."
        )
    return SpeculativeConfig("ngram", k, lo, hi)
