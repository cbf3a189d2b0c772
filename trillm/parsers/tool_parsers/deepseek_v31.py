"""DeepSeek-V3.1's calls (vLLM's ``deepseek_v31``; V3.2's chat template writes them too), as
its chat template asks::

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city":
    "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>

(without the line break): V3's calls without the ``function`` type and the JSON fences.
"""

from __future__ import annotations

from trillm.parsers.tool_parsers.sectioned import Malformed, SectionedCallParser


class DeepSeekV31ToolParser(SectionedCallParser):
    name = "deepseek_v31"
    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    ARGS_OPEN = "<｜tool▁sep｜>"
    ARGS_CLOSE = "<｜tool▁call▁end｜>"
    markers = (CALLS_BEGIN,)

    def _head(self, head: str) -> tuple[str, str | None]:
        name = head.strip()
        if not name or any(c in name for c in "\n<>｜"):
            raise Malformed
        return name, None
