"""Stage 2 moved to ``trillm.engine.preprocess`` (``Preprocessor``); these names stay
importable here for modules that still use this path."""

from trillm.engine.preprocess import InvalidRequestError, PromptType, truncate_prompt

__all__ = ["InvalidRequestError", "PromptType", "truncate_prompt"]
