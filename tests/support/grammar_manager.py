"""The grammar matchers an engine core is built with in production
(``engine_cores.structured_output_manager``), over the tiny test model's tokenizer: for tests
that build an ``EngineCore`` by hand around a stub executor."""

from __future__ import annotations

import functools

from trillm.engine.tokenizer_loader import load_tokenizer
from trillm.structured_output import GrammarCache, StructuredOutputManager
from trillm.testing.tiny_models import DEFAULT_MODEL_DIR
from trillm.tokenizer_protocol import Tokenizer


@functools.cache
def _tiny_tokenizer() -> Tokenizer:
    return load_tokenizer(str(DEFAULT_MODEL_DIR))


def grammar_manager() -> StructuredOutputManager:
    """A fresh manager (its matchers are per engine core) over one shared grammar cache's
    tokenizer; no grammar is compiled until a request asks for one."""
    tokenizer = _tiny_tokenizer()
    return StructuredOutputManager(GrammarCache(tokenizer, len(tokenizer), []))
