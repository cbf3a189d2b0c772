"""The embedded default model's tokenizer is built without ``AutoTokenizer`` (whose import
pulls in transformers' config and model-loading modules and torch, seconds of every server
start): it must be the tokenizer ``AutoTokenizer`` gives, and loading it must leave those
modules unimported."""

from __future__ import annotations

import subprocess
import sys

from transformers import AutoTokenizer

from trillm.engine.tokenizer_loader import load_tokenizer
from trillm.testing.tiny_models import DEFAULT_MODEL_DIR

TEXTS = ["Hello <|im_end|> world", "  In the beginning\nGod created", "<|im_start|>user\nhi"]


def test_the_default_tokenizer_is_the_one_auto_tokenizer_gives():
    auto = AutoTokenizer.from_pretrained(str(DEFAULT_MODEL_DIR))
    direct = load_tokenizer(str(DEFAULT_MODEL_DIR))
    assert type(direct) is type(auto)
    assert direct.init_kwargs == auto.init_kwargs
    assert direct.get_vocab() == auto.get_vocab()
    assert direct.added_tokens_decoder == auto.added_tokens_decoder
    assert direct.special_tokens_map == auto.special_tokens_map  # type: ignore[attr-defined]
    assert direct.chat_template == auto.chat_template
    for text in TEXTS:
        ids = auto.encode(text)
        assert direct.encode(text) == ids
        assert direct.decode(ids) == auto.decode(ids)


def test_loading_the_default_tokenizer_imports_neither_torch_nor_transformers_configs():
    code = (
        "import sys\n"
        "from trillm.engine.tokenizer_loader import load_tokenizer\n"
        f"load_tokenizer({str(DEFAULT_MODEL_DIR)!r})\n"
        "heavy = ('torch', 'transformers.configuration_utils', 'transformers.modeling_utils')\n"
        "print(sorted(m for m in heavy if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
