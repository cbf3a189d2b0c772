"""vLLM's dotted config flags: ``--structured-outputs-config.backend xgrammar`` (or ``=``) sets
one key of the JSON object flag ``--structured-outputs-config``; several dotted keys and an
explicit ``--structured-outputs-config JSON`` merge, the dotted keys winning. Keys may be
nested (``--hf-overrides.text_config.rope_theta 1e6``); a value is read as JSON when it parses
(``true``, ``4``, ``{"a": 1}``), else as a string; a dotted flag with no value is ``true``.

The rewritten command line holds each such flag once, as JSON, for argparse to check like any
other: a dotted flag whose base is not a flag is refused by argparse, naming it.
"""

from __future__ import annotations

import json
from typing import Any


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _set(target: dict[str, Any], keys: list[str], value: Any) -> None:
    for key in keys[:-1]:
        inner = target.get(key)
        if not isinstance(inner, dict):
            inner = target[key] = {}
        target = inner
    target[keys[-1]] = value


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def dash_flag_names(argv: list[str]) -> list[str]:
    """vLLM's spelling of flag names: ``--max_model_len`` is ``--max-model-len``. In each
    ``--`` token the name, up to its first dot (a dotted flag's keys stay as written) and
    before any ``=VALUE``, has its underscores as dashes; none after a ``--`` terminator
    (what follows it is positional, as written)."""
    out: list[str] = []
    for at, token in enumerate(argv):
        if token == "--":
            return [*out, *argv[at:]]
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            head, dot, keys = name.partition(".")
            token = head.replace("_", "-") + dot + keys + eq + value
        out.append(token)
    return out


def expand_dotted_flags(argv: list[str]) -> list[str]:
    """``argv`` with every ``--flag.key[.key] VALUE`` before any ``--`` terminator folded into
    one ``--flag JSON`` (placed before the terminator)."""
    end = argv.index("--") if "--" in argv else len(argv)
    argv, positional = argv[:end], argv[end:]
    dotted: dict[str, dict[str, Any]] = {}
    rest: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, inline = token.partition("=")
        if not (token.startswith("--") and "." in name and not name.startswith("--.")):
            rest.append(token)
            i += 1
            continue
        base, *keys = name.split(".")
        if eq:
            value: Any = _value(inline)
        elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            value = _value(argv[i + 1])
            i += 1
        else:
            value = True
        _set(dotted.setdefault(base, {}), [k.replace("-", "_") for k in keys], value)
        i += 1
    for base, values in dotted.items():
        rest = _fold(rest, base, values)
    return [*rest, *positional]


def _fold(argv: list[str], base: str, keys: dict[str, Any]) -> list[str]:
    """Merge ``keys`` into ``base``'s explicit JSON value if it has one, else append it."""
    out: list[str] = []
    explicit: dict[str, Any] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == base and i + 1 < len(argv):
            explicit, i = _object(argv[i + 1], base), i + 2
        elif token.startswith(base + "="):
            explicit, i = _object(token[len(base) + 1 :], base), i + 1
        else:
            out.append(token)
            i += 1
    return [*out, base, json.dumps(_merge(explicit, keys))]


def _object(text: str, base: str) -> dict[str, Any]:
    value = _value(text)
    if not isinstance(value, dict):
        raise SystemExit(f"trillm: error: argument {base}: must be a JSON object, got {text!r}")
    return value
