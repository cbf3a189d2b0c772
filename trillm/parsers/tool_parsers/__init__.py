"""Tool-call parsers by name (``--tool-call-parser NAME``), extensible by users.

A plugin (``--tool-parser-plugin PATH``) is a Python file that registers its parser::

    from trillm.parsers.tool_parsers import ToolParser, CallPiece, register_tool_parser

    @register_tool_parser("my_format")
    class MyParser(ToolParser):
        def split(self, text, final):  # see base.py for the contract
            ...
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from trillm.parsers.tool_parsers.base import (
    CallPiece,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
)
from trillm.parsers.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from trillm.parsers.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallParser,
    named_schema,
    required_schema,
)
from trillm.parsers.tool_parsers.hermes import HermesToolParser
from trillm.parsers.tool_parsers.json_lists import Llama3JsonToolParser, MistralToolParser
from trillm.parsers.tool_parsers.openai import OpenAIToolParser
from trillm.parsers.tool_parsers.pythonic import PythonicToolParser

__all__ = [
    "CallPiece",
    "ExtractedToolCalls",
    "NamedToolCallParser",
    "RequiredToolCallParser",
    "ToolCall",
    "ToolCallStreamer",
    "ToolParser",
    "get_tool_parser",
    "load_tool_parser_plugin",
    "named_schema",
    "register_tool_parser",
    "required_schema",
    "tool_parser_names",
]

_REGISTRY: dict[str, type[ToolParser]] = {}


def register_tool_parser(
    name: str, cls: type[ToolParser] | None = None
) -> Callable[[type[ToolParser]], type[ToolParser]]:
    """``@register_tool_parser("name")`` on a ToolParser subclass (a later one replaces an
    earlier one of the same name)."""

    def register(parser: type[ToolParser]) -> type[ToolParser]:
        if not (isinstance(parser, type) and issubclass(parser, ToolParser)):
            raise TypeError(f"tool parser {name!r} must subclass ToolParser, got {parser!r}")
        _REGISTRY[name] = parser
        return parser

    if cls is not None:
        register(cls)
    return register


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"Unknown tool-call parser {name!r}; registered: {', '.join(tool_parser_names())}."
        ) from None


def tool_parser_names() -> list[str]:
    return sorted(_REGISTRY)


def load_tool_parser_plugin(path: str) -> None:
    """Run the Python file ``path`` (which registers its parsers). Raises ValueError."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--tool-parser-plugin {path!r} is not a file.")
    module_name = f"trillm_tool_parser_plugin_{file.stem}"
    spec = importlib.util.spec_from_file_location(module_name, file)
    if spec is None or spec.loader is None:
        raise ValueError(f"--tool-parser-plugin {path!r} cannot be loaded as Python.")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as exc:
        raise ValueError(f"--tool-parser-plugin {path!r} failed to load: {exc!r}") from exc


for _parser in (
    DeepSeekV3ToolParser,
    HermesToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    OpenAIToolParser,
    PythonicToolParser,
):
    register_tool_parser(_parser.name, _parser)
# vLLM's names for Llama 4's tool-call formats: pythonic calls (in <|python_start|> tags or
# not) and Llama 3's JSON objects, which these parsers read already.
register_tool_parser("llama4_pythonic", PythonicToolParser)
register_tool_parser("llama4_json", Llama3JsonToolParser)
