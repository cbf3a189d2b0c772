"""Structured outputs (JSON schema, regex, choice, EBNF grammar, structural tags) with xgrammar.

- ``spec.py``: ``StructuredOutputsParams`` checked and reduced to a hashable ``GrammarSpec``.
- ``compiler.py``: ``GrammarCache``, compiles off the event loop, cache keyed by the spec.
- ``manager.py``: ``StructuredOutputManager``, the engine core's matchers: bitmask (P2),
  accepted tokens (P4), rollback.
"""

from trillm.structured_output.compiler import COMPILE_TIMEOUT_S, GrammarCache
from trillm.structured_output.manager import StructuredOutputManager
from trillm.structured_output.spec import GrammarSpec, StructuredOutputError, check_params

__all__ = [
    "COMPILE_TIMEOUT_S",
    "GrammarCache",
    "GrammarSpec",
    "StructuredOutputError",
    "StructuredOutputManager",
    "check_params",
]
