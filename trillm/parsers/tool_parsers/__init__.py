"""Tool-call parsers by name (``--tool-call-parser NAME``), extensible by users.

A plugin (``--tool-parser-plugin PATH``) is a Python file that registers its parser::

    from trillm.parsers.tool_parsers import ToolParser, CallPiece, register_tool_parser

    @register_tool_parser("my_format")
    class MyParser(ToolParser):
        def split(self, text, final):  # see base.py for the contract
            ...
"""

from __future__ import annotations

from collections.abc import Callable

from trillm.parsers.tool_parsers.base import (
    CallPiece,
    ExtractedToolCalls,
    ToolCall,
    ToolCallStreamer,
    ToolParser,
)
from trillm.parsers.tool_parsers.deepseek_v3 import DeepSeekV3ToolParser
from trillm.parsers.tool_parsers.deepseek_v31 import DeepSeekV31ToolParser
from trillm.parsers.tool_parsers.forced import (
    NamedToolCallParser,
    RequiredToolCallParser,
    named_schema,
    required_schema,
)
from trillm.parsers.tool_parsers.glm45 import Glm45ToolParser
from trillm.parsers.tool_parsers.hermes import HermesToolParser, InternLMToolParser
from trillm.parsers.tool_parsers.jamba import JambaToolParser
from trillm.parsers.tool_parsers.json_lists import (
    GraniteToolParser,
    Llama3JsonToolParser,
    MistralToolParser,
    Phi4MiniJsonToolParser,
)
from trillm.parsers.tool_parsers.kimi_k2 import KimiK2ToolParser
from trillm.parsers.tool_parsers.minimax_m2 import MiniMaxM2ToolParser
from trillm.parsers.tool_parsers.openai import OpenAIToolParser
from trillm.parsers.tool_parsers.pythonic import PythonicToolParser
from trillm.parsers.tool_parsers.qwen3_coder import Qwen3CoderToolParser

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
    from trillm.parsers.plugin_files import run_plugin_file

    run_plugin_file(path, "--tool-parser-plugin")


for _parser in (
    DeepSeekV3ToolParser,
    DeepSeekV31ToolParser,
    Glm45ToolParser,
    GraniteToolParser,
    HermesToolParser,
    InternLMToolParser,
    JambaToolParser,
    KimiK2ToolParser,
    Llama3JsonToolParser,
    MiniMaxM2ToolParser,
    MistralToolParser,
    OpenAIToolParser,
    Phi4MiniJsonToolParser,
    PythonicToolParser,
    Qwen3CoderToolParser,
):
    register_tool_parser(_parser.name, _parser)
# vLLM's names for Llama 4's tool-call formats: pythonic calls (in <|python_start|> tags or
# not) and Llama 3's JSON objects, which these parsers read already.
register_tool_parser("llama4_pythonic", PythonicToolParser)
register_tool_parser("llama4_json", Llama3JsonToolParser)
# vLLM's second parser for Qwen3-Coder's XML calls (the same format, another implementation).
register_tool_parser("qwen3_xml", Qwen3CoderToolParser)
