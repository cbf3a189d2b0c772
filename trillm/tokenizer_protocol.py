"""The tokenizer as trillm uses it (``Tokenizer``), one of the seams ``trillm/interfaces.py``
lists. This module imports nothing of trillm, so every stage that takes a tokenizer can name
it without closing an import cycle."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol, overload

if TYPE_CHECKING:
    from tokenizers import AddedToken


class Tokenizer(Protocol):
    """A transformers tokenizer, as far as trillm uses one: stage 2 (encode, the chat
    template's text and special tokens, EOS, the prompt-length bound), stage 10 (decode, the
    logprob texts; the detokenizer reads the ``tokenizers`` backend behind it,
    ``engine/vocab_spec.backend_tokenizer``), the parsers (special tokens, the think tags' ids),
    structured outputs (xgrammar reads it whole) and the HTTP routes (tokenize, detokenize,
    tokenizer_info, a pair for scoring)."""

    chat_template: str | dict[str, str] | None  # transformers: one template, or named ones

    @property
    def eos_token_id(self) -> int | None: ...

    # The named special tokens, as chat templates read them (``{{ bos_token }}``).
    @property
    def bos_token(self) -> str | None: ...

    @property
    def eos_token(self) -> str | None: ...

    @property
    def pad_token(self) -> str | None: ...

    @property
    def unk_token(self) -> str | None: ...

    @property
    def all_special_tokens(self) -> list[str]: ...

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]: ...  # id -> added token

    @property
    def clean_up_tokenization_spaces(self) -> bool: ...

    @property
    def init_kwargs(self) -> dict[str, object]: ...  # tokenizer_config.json's entries

    def __len__(self) -> int: ...  # the vocabulary, added tokens included

    def get_vocab(self) -> dict[str, int]: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: int) -> str: ...

    @overload
    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]: ...

    def __call__(
        self, text: str, text_pair: str, *, truncation: bool = False, max_length: int | None = None
    ) -> Mapping[str, list[int]]: ...  # a pair: input_ids, token_type_ids, attention_mask
