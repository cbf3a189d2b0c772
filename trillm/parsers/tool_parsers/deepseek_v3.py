"""DeepSeek-V3 / R1 calls (vLLM's ``deepseek_v3`` parser), as their chat template asks::

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time
    ```json
    {"tz": "CET"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

Text before the calls' block is content (after it too, where a model writes any). A block
that does not read as calls (a call without its name, fences or end tag, arguments that are not
a JSON object) leaves the whole output content, as for the other parsers (``sectioned.py``,
which reads V3.1's and Kimi K2's calls too).
"""

from __future__ import annotations

from trillm.parsers.tool_parsers.sectioned import Malformed, SectionedCallParser

CALL_TYPE = "function<｜tool▁sep｜>"


class DeepSeekV3ToolParser(SectionedCallParser):
    name = "deepseek_v3"
    CALLS_BEGIN = "<｜tool▁calls▁begin｜>"
    CALLS_END = "<｜tool▁calls▁end｜>"
    CALL_BEGIN = "<｜tool▁call▁begin｜>"
    # The fences around the arguments: the newlines beside them are whitespace around JSON.
    ARGS_OPEN = "```json"
    ARGS_CLOSE = "```<｜tool▁call▁end｜>"
    markers = (CALLS_BEGIN,)

    def _head(self, head: str) -> tuple[str, str | None]:
        if not head.startswith(CALL_TYPE) or not head.endswith("\n"):
            raise Malformed
        name = head[len(CALL_TYPE) : -1]
        if not name or any(c in name for c in "\n<>｜"):
            raise Malformed
        return name, None
