# ext/detokenizer.cpp (pybind11); Python twins: trillm.engine.detokenizer.PyVocab and
# PyIncrementalDetokenizer, same parameters (tests/test_native_contract.py).
from collections.abc import Sequence

class Vocab:
    scheme: int
    size: int
    strip_leading_spaces: int
    def __init__(
        self,
        table: Sequence[bytes],
        special_ids: Sequence[int],
        scheme: int = 0,
        byte_token_ids: Sequence[int] = ...,
        strip_leading_spaces: int = 0,
        first_table: Sequence[bytes] = ...,
    ) -> None: ...

class IncrementalDetokenizer:
    def __init__(
        self, vocab: Vocab, skip_special_tokens: bool, prompt_token_ids: Sequence[int] = ...
    ) -> None: ...
    def add_tokens(self, ids: Sequence[int]) -> str: ...
    def flush(self) -> str: ...
    @property
    def has_pending(self) -> bool: ...
