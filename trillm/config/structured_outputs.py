"""vLLM's ``structured_outputs_config`` engine argument (``--structured-outputs-config JSON`` or
``--structured-outputs-config.KEY VALUE``): every key vLLM defines, honoured or refused.

trillm compiles every constraint with xgrammar. The backend names vLLM offers are accepted
where xgrammar serves the same constraint (JSON schemas, JSON objects, regexes, choices and
structural tags mean the same to each backend); a ``grammar`` request is refused under
``guidance``, ``outlines`` or ``lm-format-enforcer``, whose grammars are written in other
syntaxes (Lark, or none) than the EBNF xgrammar reads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
# Backends whose grammar syntax xgrammar does not read (their other constraints it serves).
FOREIGN_GRAMMAR_BACKENDS = ("guidance", "outlines", "lm-format-enforcer")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    backend: str = "auto"
    # vLLM falls back to another backend when its first choice refuses a constraint; trillm has
    # one backend, so there is nothing to fall back to either way.
    disable_fallback: bool = False
    # Engine-wide defaults of the request fields of the same name (a request may also set them).
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    reasoning_parser_plugin: str = ""
    # Constrain from the first token, reasoning included (default: only after it ends).
    enable_in_reasoning: bool = False

    def grammar_refusal(self) -> str | None:
        """Why a ``grammar`` constraint cannot be served under this backend (None: it can)."""
        if self.backend not in FOREIGN_GRAMMAR_BACKENDS:
            return None
        return (
            f"structured_outputs_config backend {self.backend!r}: its grammar syntax is not "
            "implemented; trillm reads grammars as xgrammar's EBNF (backend 'xgrammar' or "
            "'auto'). JSON schemas, regexes and choices work under every backend."
        )


def parse_structured_outputs_config(value: Any) -> StructuredOutputsConfig:
    """A dict (or None) -> the config; ValueError naming the key or value it cannot take."""
    if value is None:
        return StructuredOutputsConfig()
    if isinstance(value, StructuredOutputsConfig):
        return value
    if not isinstance(value, dict):
        raise ValueError(f"structured_outputs_config must be a JSON object, got {value!r}.")
    known = {f.name: f for f in fields(StructuredOutputsConfig)}
    for key, item in value.items():
        if key not in known:
            raise ValueError(
                f"structured_outputs_config: unknown key {key!r}; known: {', '.join(known)}."
            )
        want = bool if known[key].type == "bool" else str
        if not isinstance(item, want):
            raise ValueError(
                f"structured_outputs_config.{key} must be a {want.__name__}, got {item!r}."
            )
    config = StructuredOutputsConfig(**value)
    if config.backend not in BACKENDS:
        raise ValueError(
            f"structured_outputs_config.backend {config.backend!r} is not one of "
            f"{', '.join(BACKENDS)}."
        )
    return config
