"""Output parsers shared by the HTTP server and the Python API (issue 12).

``tool_parsers``: model-family tool-call formats (hermes, llama3_json, mistral, pythonic) in a
registry users extend with ``--tool-parser-plugin``; ``reasoning``: ``<think>`` sections
(deepseek_r1, qwen3). Each parses a finished output at once and a stream delta by delta, and
both give the same result.
"""
