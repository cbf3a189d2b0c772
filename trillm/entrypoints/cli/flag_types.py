"""The values ``trillm serve``'s flags take: argparse ``type=`` functions, each an
``ArgumentTypeError`` (a usage error naming the flag) for anything else."""

from __future__ import annotations

import argparse
import json
import math
from typing import Any

from trillm.config import check_grammar_cache_bytes, parse_memory_size


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
