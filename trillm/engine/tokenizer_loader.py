"""The model's tokenizer, loaded by transformers (``AutoTokenizer``) and typed here, the one
place where transformers' object (untyped: ``Any`` to mypy) becomes the ``Tokenizer`` that
every seam declares (``trillm/interfaces.py``)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from trillm.tokenizer_protocol import Tokenizer


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Tokenizer:
    """The tokenizer of a model folder, a hub id or a ``.gguf`` file (whose metadata holds
    its tokenizer and chat template)."""
    if is_default_model(path):
        return load_default_tokenizer(path)
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        file = Path(path).expanduser()
        loaded = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    else:
        # trust_remote_code: a tokenizer class shipped with the checkpoint may run (vLLM's
        # meaning).
        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return cast("Tokenizer", loaded)


def is_default_model(path: str) -> bool:
    from trillm.default_model import HERE

    return Path(path).expanduser().resolve() == HERE


def load_default_tokenizer(path: str) -> Tokenizer:
    """The embedded default model's tokenizer, the class ``AutoTokenizer`` picks for it
    (``TokenizersBackend``: its tokenizer_config.json names ``PreTrainedTokenizerFast``, no
    auto_map), built directly. ``AutoTokenizer``'s import pulls in transformers' config and
    model-loading modules and torch (about 3 CPU s of every server start); this one does not."""
    from transformers import TokenizersBackend

    return cast("Tokenizer", TokenizersBackend.from_pretrained(path))
