"""The tokenizer ``load_tokenizer`` returns keeps the ``Tokenizer`` protocol
(``trillm/tokenizer_protocol.py``) at run time: mypy sees transformers' objects as ``Any``, so only
this test holds the protocol's members and types to what transformers gives. Every member of
the protocol has a check here (a member added without one fails), run on the default model's
byte-level BPE tokenizer and on a tiny BERT's WordPiece one (segment ids, a pair)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import pytest
from tokenizers import AddedToken
from tokenizers import Tokenizer as BackendTokenizer

from trillm.engine.tokenizer_loader import load_tokenizer
from trillm.engine.vocab_spec import backend_tokenizer
from trillm.testing.tiny_models import DEFAULT_MODEL_DIR
from trillm.tokenizer_protocol import Tokenizer


@pytest.fixture(scope="module", params=["default", "bert"])
def tok(request, tmp_path_factory) -> Tokenizer:
    if request.param == "default":
        return load_tokenizer(str(DEFAULT_MODEL_DIR))
    from trillm.testing.tiny_bert import build_tiny_encoder

    folder = build_tiny_encoder("BertModel", tmp_path_factory.mktemp("bert"))
    return load_tokenizer(str(folder))


def _optional_str(value: object) -> bool:
    return value is None or isinstance(value, str)


def _added(tok: Tokenizer) -> bool:
    items = tok.added_tokens_decoder.items()
    return bool(items) and all(
        isinstance(i, int) and isinstance(t, AddedToken) and isinstance(t.content, str)
        and isinstance(t.special, bool)
        for i, t in items
    )  # fmt: skip


def _vocab(tok: Tokenizer) -> bool:
    vocab = tok.get_vocab()
    return len(vocab) == len(tok) and all(
        isinstance(k, str) and isinstance(v, int) for k, v in vocab.items()
    )


def _pair(tok: Tokenizer) -> bool:
    whole = tok("hello there world", "a second text")
    cut = tok("hello there world", "a second text", truncation=True, max_length=5)
    ids = whole["input_ids"]
    return (
        isinstance(whole, Mapping)
        and all(isinstance(t, int) for t in ids)
        and len(cut["input_ids"]) == 5 < len(ids)
    )


# member -> a check of what the loaded tokenizer gives for it
CHECKS: dict[str, Callable[[Tokenizer], bool]] = {
    "chat_template": lambda tok: tok.chat_template is None or isinstance(tok.chat_template, str),
    "eos_token_id": lambda tok: tok.eos_token_id is None or isinstance(tok.eos_token_id, int),
    "bos_token": lambda tok: _optional_str(tok.bos_token),
    "eos_token": lambda tok: _optional_str(tok.eos_token),
    "pad_token": lambda tok: _optional_str(tok.pad_token),
    "unk_token": lambda tok: _optional_str(tok.unk_token),
    "all_special_tokens": lambda tok: all(isinstance(t, str) for t in tok.all_special_tokens),
    "added_tokens_decoder": _added,
    "clean_up_tokenization_spaces": lambda tok: isinstance(tok.clean_up_tokenization_spaces, bool),
    "init_kwargs": lambda tok: all(isinstance(k, str) for k in tok.init_kwargs),
    "__len__": lambda tok: len(tok) > 0,
    "get_vocab": _vocab,
    "encode": lambda tok: (
        all(isinstance(i, int) for i in tok.encode("hello", add_special_tokens=False))
        and len(tok.encode("hello")) >= len(tok.encode("hello", add_special_tokens=False))
    ),
    "decode": lambda tok: tok.decode(tok.encode("hello", add_special_tokens=False)) == "hello",
    "convert_ids_to_tokens": lambda tok: (
        isinstance(tok.convert_ids_to_tokens(5), str)
        and tok.convert_ids_to_tokens([5, 6]) == [tok.convert_ids_to_tokens(i) for i in (5, 6)]
    ),
    "__call__": _pair,
}


def _protocol_members() -> set[str]:
    own = {name for name in vars(Tokenizer) if not name.startswith("_")}
    dunders = {"__len__", "__call__"} & set(vars(Tokenizer))
    return own | set(Tokenizer.__annotations__) | dunders


def test_every_protocol_member_has_a_check():
    assert set(CHECKS) == _protocol_members()


@pytest.mark.parametrize("member", sorted(CHECKS))
def test_the_loaded_tokenizer_keeps_the_protocol(tok, member):
    assert CHECKS[member](tok), member


def test_the_detokenizer_reads_the_backend_behind_the_tokenizer(tok, tmp_path: Path):
    backend = backend_tokenizer(tok)
    assert isinstance(backend, BackendTokenizer)
    assert backend_tokenizer(backend) is backend  # a bare ``tokenizers`` tokenizer: itself
    with pytest.raises(TypeError, match="not backed by a `tokenizers` tokenizer"):
        backend_tokenizer(tmp_path)  # type: ignore[arg-type]
