"""The values ``trillm serve``'s flags take: argparse ``type=`` functions, each an
``ArgumentTypeError`` (a usage error naming the flag) for anything else. ``ENGINE_VALUES``:
those an EngineArgs field's ``Flag.value`` names (``trillm/config/engine_args.py``)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from typing import Any

from trillm.config import (
    LOAD_FORMATS,
    FlagValue,
    check_grammar_cache_bytes,
    check_kv_cache_dtype,
    parse_memory_size,
)


def json_object(value: str) -> dict[str, Any]:
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return parsed


def memory_size(value: str) -> int:
    try:
        return parse_memory_size(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def grammar_cache_bytes(value: str) -> int:
    try:
        return check_grammar_cache_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        number = -1
    if number < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {value!r}")
    return number


def positive_int(value: str) -> int:
    number = non_negative_int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {value!r}")
    return number


def health_step_timeout(value: str) -> float | None:
    seconds = float(value)
    if seconds == 0:
        return None
    if not math.isfinite(seconds) or seconds < 0:
        raise argparse.ArgumentTypeError(f"must be a number of seconds >= 0, got {value}")
    return seconds


def positive_seconds(value: str) -> float:
    seconds = float(value)
    if not seconds > 0 or seconds == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return seconds


def quantization(value: str) -> str:
    from trillm.model_executor.quantization import UnsupportedQuantizationError, check_quantization

    try:
        return check_quantization(value)
    except UnsupportedQuantizationError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def kv_cache_dtype(value: str) -> str:
    try:
        return check_kv_cache_dtype(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def load_format(value: str) -> str:
    if value not in LOAD_FORMATS:
        raise argparse.ArgumentTypeError(
            f"load format {value!r} is not implemented yet; trillm reads safetensors "
            f"checkpoints and GGUF files: choose one of {', '.join(LOAD_FORMATS)}."
        )
    return value


def speculative_config(value: str) -> dict[str, Any]:
    """``--speculative-config`` JSON -> the dict EngineArgs takes (checked here: exit 2)."""
    from trillm.spec_decode.config import parse_speculative_config

    try:
        parse_speculative_config(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return json.loads(value)


def limit_mm_per_prompt(value: str) -> dict[str, int]:
    """``--limit-mm-per-prompt`` JSON -> the dict EngineArgs takes (checked here: exit 2)."""
    from trillm.config.multimodal import check_limit_mm_per_prompt

    try:
        limits = check_limit_mm_per_prompt(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    assert limits is not None
    return limits


def host(value: str) -> str:
    """One of ``--allowed-media-domains``: a host name as a URL spells it (no scheme, path)."""
    if not value or any(c in value for c in "/:@ ?#"):
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a host name (e.g. upload.wikimedia.org: no scheme, port or path)."
        )
    return value.lower()


def class_name(value: str) -> str:
    """One of ``--logits-processors``: ``pkg.module:ClassName`` or ``pkg.module.ClassName``
    (imported when the engine is built, which refuses one that does not import)."""
    if not value.strip() or " " in value.strip():
        raise argparse.ArgumentTypeError(
            f"{value!r} is not a class name like 'pkg.module:ClassName'."
        )
    return value.strip()


ENGINE_VALUES: dict[FlagValue, Callable[[str], Any]] = {
    "positive_int": positive_int,
    "non_negative_int": non_negative_int,
    "positive_seconds": positive_seconds,
    "memory_size": memory_size,
    "grammar_cache_bytes": grammar_cache_bytes,
    "json_object": json_object,
    "quantization": quantization,
    "kv_cache_dtype": kv_cache_dtype,
    "load_format": load_format,
    "speculative_config": speculative_config,
    "limit_mm_per_prompt": limit_mm_per_prompt,
    "host": host,
    "class_name": class_name,
}
