"""``--skip-tokenizer-init`` (vLLM's flag): no tokenizer is loaded. The engine then takes
prompts as token ids only and returns token ids with empty text (no detokenization, as vLLM's
``detokenize=False``); whatever needs the tokenizer (text prompts, chat templates, stop strings,
bad words, structured outputs) is refused by name (``TokenizerSkipped``, a 400)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tokenizers import AddedToken

    from trillm.sampling_params import SamplingParams

FLAG = "--skip-tokenizer-init"


class TokenizerSkipped(ValueError):
    """A request needs the tokenizer, which ``--skip-tokenizer-init`` did not load."""

    def __init__(self, what: str, param: str | None = None) -> None:
        super().__init__(
            f"{what} needs the tokenizer, which this server did not load "
            f"({FLAG} / skip_tokenizer_init): give the prompt as token ids."
        )
        self.param = param


class SkippedTokenizer:
    """Stands where the tokenizer would (``tokenizer_protocol.Tokenizer``): no EOS of its own
    (generation_config's EOS ids still stop), no special tokens, no vocabulary; each text
    operation raises ``TokenizerSkipped``;
    decoding gives empty text."""

    chat_template: str | dict[str, str] | None = None
    eos_token_id: int | None = None
    bos_token: str | None = None
    eos_token: str | None = None
    pad_token: str | None = None
    unk_token: str | None = None
    clean_up_tokenization_spaces = False

    @property
    def all_special_tokens(self) -> list[str]:
        return []

    @property
    def added_tokens_decoder(self) -> dict[int, AddedToken]:
        return {}

    @property
    def init_kwargs(self) -> dict[str, object]:
        return {}

    def __len__(self) -> int:
        return 0  # no added tokens beyond the model's vocabulary

    def get_vocab(self) -> dict[str, int]:
        return {}  # no token strings (bounds on text fall back to their floors)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise TokenizerSkipped("A text prompt", "prompt")

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return ""  # vLLM's outputs without a tokenizer: token ids, empty texts

    def convert_ids_to_tokens(self, ids: Any) -> Any:
        raise TokenizerSkipped("Token strings")

    def __call__(
        self, text: str, text_pair: str, *, truncation: bool = False, max_length: int | None = None
    ) -> Mapping[str, list[int]]:
        raise TokenizerSkipped("A text pair")


def skipped_tokenizer_params(params: SamplingParams) -> None:
    """A request's sampling params without a tokenizer: what needs one is refused by name;
    no detokenization (the outputs carry token ids, their text stays empty)."""
    for name, what in (
        ("stop", "stop (stop strings)"),
        ("bad_words", "bad_words"),
        ("structured_outputs", "structured_outputs (guided decoding)"),
    ):
        if getattr(params, name):
            raise TokenizerSkipped(what, name)
    params.detokenize = False
