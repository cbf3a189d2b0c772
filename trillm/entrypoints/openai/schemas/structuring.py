"""Strict structuring of decoded JSON into the request schemas (``protocol.py`` and its
siblings).

Unknown fields are accepted and ignored (OpenAI clients send extras), but for vLLM's fields this
server does not implement (``vllm_refused``: a 400 naming one that asks for something). Known
fields are checked for type and range, and the first bad one is reported with its path as
``param`` (``temperature``, ``messages[1].content``). Ranges come from each field's metadata
(``protocol._f``), the declaration the OpenAPI schema is generated from too.

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

from trillm.entrypoints.openai.http.errors import BadRequestError
from trillm.entrypoints.openai.schemas.vllm_refused import refusal
from trillm.sampling_params import FLOAT32_MAX, INT64_MAX, INT64_MIN

# The name the unknown-fields warning has always been logged under.
logger = logging.getLogger("trillm.entrypoints.openai.schemas.protocol")


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
        if not path:
            _refuse_vllm_fields(cls, data, hints)
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


def _refuse_vllm_fields(cls: type[Any], data: dict[str, Any], hints: dict[str, Any]) -> None:
    """A vLLM field this schema does not declare is a 400 when its value asks for something
    (``vllm_refused``); any other unknown field is ignored, as vLLM ignores it."""
    for key in data:
        if key not in hints:
            message = refusal(cls.__name__, key, data[key])
            if message is not None:
                raise BadRequestError(message, key)


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
    # Numbers by their JSON kind alone: a number out of range is the branch's error to tell
    # (a seed past 64 bits is an integer too big, not "not an integer").
    if tp is int:
        return _is_json_integer(value)
    if tp is float:
        return isinstance(value, int | float) and not isinstance(value, bool)
    try:
        _structure_scalar(value, tp, "")
    except BadRequestError:
        return False
    return True


_LAX_BOOLS = {
    **dict.fromkeys(("1", "on", "t", "true", "y", "yes"), True),
    **dict.fromkeys(("0", "off", "f", "false", "n", "no"), False),
}


def _structure_scalar(value: Any, tp: Any, path: str) -> Any:
    if tp is bool:
        if isinstance(value, bool):
            return value
        # As vLLM's pydantic models (lax mode): "true"/"yes"/"on"/"1"... and 0 / 1.
        if isinstance(value, str) and value.lower() in _LAX_BOOLS:
            return _LAX_BOOLS[value.lower()]
        if type(value) is int and value in (0, 1):
            return bool(value)
        raise _type_error(path, "a boolean", value)
    if tp is int:
        # NOTE: JSON integers past 64 bits arrive as floats (rounded: -2**63 - 1 becomes
        # -2**63); a float can only stand for an integer strictly inside the int64 range.
        if isinstance(value, float) and value.is_integer() and -(2.0**63) < value < 2.0**63:
            value = int(value)
        elif isinstance(value, float) and value.is_integer():
            # (its digits: lost in JSON)
            raise _int64_error(path, "an integer beyond that", value < 0)
        if isinstance(value, int) and not isinstance(value, bool):
            if not INT64_MIN <= value <= INT64_MAX:
                raise _int64_error(path, str(value), value < 0)
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
    raise TypeError(f"structuring: no structuring rule for {tp!r}")  # a bug in this module


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is list:
        inner = _describe(typing.get_args(tp)[0]).removeprefix("an ").removeprefix("a ")
        if inner.startswith("array of "):  # "an array of arrays of integers"
            return f"an array of arrays of {inner.removeprefix('array of ')}"
        return f"an array of {inner}s"
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


def _is_json_integer(value: Any) -> bool:
    if isinstance(value, float):
        return value.is_integer()
    return isinstance(value, int) and not isinstance(value, bool)


def _int64_error(path: str, shown: str, below: bool) -> BadRequestError:
    # The bound's pydantic error type ends the message, as in vLLM's 400s, which clients match.
    kind = "greater_than_equal" if below else "less_than_equal"
    return BadRequestError(
        f"'{path}' must be a 64-bit integer, from {INT64_MIN} to {INT64_MAX}; got {shown} "
        f"({kind}).",
        path,
    )


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
    if "max_parts" in limits and isinstance(value, list):
        _check_parts(value, limits["max_parts"], path)
    limit = limits.get("max_len")
    if (
        limit is None
        and "max_prompts" in limits
        and isinstance(value, list)  # an object is no prompt: structuring says so
        and value
        and not isinstance(value[0], int)
    ):
        limit = limits["max_prompts"]  # a list of prompts (a list of ints is one prompt)
    if limit is not None and len(value) > limit:
        raise BadRequestError(
            f"'{path}' has {len(value)} entries, more than the limit of {limit}.", path
        )


def _check_parts(messages: list[Any], limit: int, path: str) -> None:
    """Content parts of all ``messages`` together (a list ``content``'s entries, and those of
    a part's own list ``content``: Anthropic's tool results), counted on the raw JSON: each
    costs what a message costs to structure, render and tokenize, so a chat of few messages
    and 500,000 parts cost 11-31 s of CPU before its context-length refusal."""
    total = 0
    for i, message in enumerate(messages):
        content = message.get("content") if isinstance(message, dict) else None
        if not isinstance(content, list):
            continue
        total += len(content)
        if total <= limit:
            total += sum(
                len(part["content"])
                for part in content
                if isinstance(part, dict) and isinstance(part.get("content"), list)
            )
        if total > limit:
            raise BadRequestError(
                f"'{path}' has more than {limit} content parts in all (passed at "
                f"'{path}[{i}].content').",
                f"{path}[{i}].content",
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
