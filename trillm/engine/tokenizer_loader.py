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
    from transformers import AutoTokenizer

    if path.endswith(".gguf"):
        file = Path(path).expanduser()
        loaded = AutoTokenizer.from_pretrained(str(file.parent), gguf_file=file.name)
    else:
        # trust_remote_code: a tokenizer class shipped with the checkpoint may run (vLLM's
        # meaning).
        loaded = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    return cast("Tokenizer", loaded)
