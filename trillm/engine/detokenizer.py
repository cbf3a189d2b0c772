"""Stage 10: incremental detokenization (native twin: ``ext/detokenizer.cpp``).

A token -> bytes table is built once per tokenizer (``build_vocab_spec``, ``vocab_spec.py``);
each request then owns an ``IncrementalDetokenizer`` holding only its undecided bytes.
``add_tokens(ids)`` returns the text that became *final* (it can never change whatever tokens
follow) and ``flush()`` returns the rest at the end of the request, so that for every request

    prompt_text + "".join(emitted) == tokenizer.decode(prompt_ids + output_ids)

where ``prompt_text`` is what the prompt ids emit while priming (discarded). With no prompt,
the emitted text is exactly ``tokenizer.decode(output_ids, skip_special_tokens=...)``.

Two decoder pipelines are modelled exactly; anything else goes to ``tokenizers``'
``DecodeStream`` (``StreamDetokenizer``):

- ``BYTE_LEVEL`` (GPT-2 style ``ByteLevel`` decoder): every token is a byte string, all bytes
  are concatenated and decoded as UTF-8 with U+FFFD for each maximal invalid subpart
  (``errors='replace'``). Bytes of an incomplete trailing sequence are held back.
- ``BYTE_FALLBACK`` (SentencePiece style: ``Replace('▁', ' ')``, ``ByteFallback``, ``Fuse``,
  ``Strip(' ', k, 0)``, or ``Metaspace``): text tokens are their string with '▁' -> ' ';
  a run of consecutive ``<0xNN>`` tokens decodes as strict UTF-8, or, if the run is not
  valid UTF-8 as a whole, as one U+FFFD per byte. A run is held back until a text token ends
  it or it is proven invalid. The first ``k`` leading spaces of the whole text are stripped
  (``Strip``); ``Metaspace`` instead drops every '▁' of the first token (``first_table``).

The native class and the Python twin take the same arguments and return the same strings;
``TRILLM_NO_EXTENSIONS=1`` (or ``native=False``) forces the twin.
"""

from __future__ import annotations

import codecs
import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from trillm.engine.vocab_spec import DecoderScheme, VocabSpec, backend_tokenizer, build_vocab_spec

if TYPE_CHECKING:
    from tokenizers import Tokenizer as BackendTokenizer

    from trillm.tokenizer_protocol import Tokenizer

logger = logging.getLogger(__name__)

REPLACEMENT_CHAR = "\ufffd"


def surrogate_lead(pending: bytes) -> bool:
    """True for ED A0..BF held back by an incremental UTF-8 decoder: CPython's waits for a
    third byte there, but no byte makes a UTF-16 surrogate's encoding valid (the native twin
    and ``bytes.decode`` take both bytes as invalid at once)."""
    return len(pending) == 2 and pending[0] == 0xED and pending[1] >= 0xA0


class Detokenizer(Protocol):
    """What the output processor needs from any of the implementations."""

    def add_tokens(self, ids: Sequence[int]) -> str: ...

    def flush(self) -> str: ...

    @property
    def has_pending(self) -> bool: ...


# ---------------------------------------------------------------- Python twin


class PyVocab:
    """Python twin of ``trillm._ext.detokenizer.Vocab``."""

    def __init__(
        self,
        table: list[bytes],
        special_ids: list[int],
        scheme: int = DecoderScheme.BYTE_LEVEL,
        byte_token_ids: Sequence[int] = (),
        strip_leading_spaces: int = 0,
        first_table: Sequence[bytes] = (),
    ) -> None:
        self.scheme = DecoderScheme(scheme)
        if first_table and len(first_table) != len(table):
            raise ValueError("first_table must be empty or as long as table.")
        self.strip_leading_spaces = strip_leading_spaces
        self.size = len(table)
        skipped = set(special_ids)
        byte_ids = set(byte_token_ids)
        for i in (*skipped, *byte_ids):
            if not 0 <= i < len(table):
                raise IndexError(f"token id {i} is outside the table of {len(table)} tokens.")
        if any(len(table[i]) != 1 for i in byte_ids):
            raise ValueError("a byte token's table entry must be exactly one byte.")
        self.table = list(table)
        self.table_skipping = [b"" if i in skipped else t for i, t in enumerate(table)]
        # BYTE_FALLBACK: a text token's string, or an int for a byte token.
        self.pieces: list[str | int] = [
            t[0] if i in byte_ids else t.decode("utf-8", "replace") for i, t in enumerate(table)
        ]
        self.special = [i in skipped for i in range(len(table))]
        self.first_pieces: list[str | int] = [
            self.pieces[i] if i in byte_ids else t.decode("utf-8", "replace")
            for i, t in enumerate(first_table)
        ]


class PyIncrementalDetokenizer:
    """Python twin of ``trillm._ext.detokenizer.IncrementalDetokenizer``."""

    def __init__(
        self, vocab: PyVocab, skip_special_tokens: bool, prompt_token_ids: Sequence[int] = ()
    ) -> None:
        self._vocab = vocab
        self._skip = skip_special_tokens
        self._strip_left = vocab.strip_leading_spaces
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")  # BYTE_LEVEL
        self._run = bytearray()  # BYTE_FALLBACK: the open run of byte tokens, valid so far
        self._run_check = codecs.getincrementaldecoder("utf-8")("strict")
        self._run_invalid = False  # the open run is already known to be all U+FFFD
        self._first = bool(vocab.first_pieces)  # the next kept token is the first one
        if prompt_token_ids:
            self.add_tokens(prompt_token_ids)  # primes the state; the prompt's text is not ours

    @property
    def has_pending(self) -> bool:
        """True while some bytes are held back (the text so far is not all final)."""
        if self._vocab.scheme == DecoderScheme.BYTE_LEVEL:
            return bool(self._utf8.getstate()[0])
        return bool(self._run)

    def add_tokens(self, ids: Sequence[int]) -> str:
        if ids and (min(ids) < 0 or max(ids) >= self._vocab.size):
            if min(ids) < 0:
                raise IndexError("a token id is negative.")
            # NOTE: ids past the tokenizer (a model's padded vocabulary can sample them) have
            # no text, as in the tokenizer's own decode: they must never fail the request.
            ids = [i for i in ids if i < self._vocab.size]
        if self._vocab.scheme == DecoderScheme.BYTE_LEVEL:
            table = self._vocab.table_skipping if self._skip else self._vocab.table
            text = self._utf8.decode(b"".join([table[i] for i in ids]))
            if surrogate_lead(self._utf8.getstate()[0]):  # two bytes no byte can complete
                self._utf8.reset()
                text += REPLACEMENT_CHAR * 2
            return text
        return self._strip("".join(self._byte_fallback_pieces(ids)))

    def flush(self) -> str:
        if self._vocab.scheme == DecoderScheme.BYTE_LEVEL:
            return self._utf8.decode(b"", final=True)
        return self._strip(self._close_run())

    def _byte_fallback_pieces(self, ids: Sequence[int]) -> list[str]:
        out: list[str] = []
        pieces, special = self._vocab.pieces, self._vocab.special
        for i in ids:
            if self._skip and special[i]:
                continue
            if self._first:
                self._first = False
                piece = self._vocab.first_pieces[i]
            else:
                piece = pieces[i]
            if isinstance(piece, str):
                out.append(self._close_run())
                out.append(piece)
            else:
                out.append(self._add_run_byte(piece))
        return out

    def _add_run_byte(self, byte: int) -> str:
        if self._run_invalid:
            return REPLACEMENT_CHAR
        self._run.append(byte)
        try:
            self._run_check.decode(bytes([byte]))
            if surrogate_lead(self._run_check.getstate()[0]):
                raise UnicodeDecodeError("utf-8", bytes(self._run), 0, 2, "a surrogate")
        except UnicodeDecodeError:
            # ByteFallback turns an invalid run into one U+FFFD per byte, whatever follows.
            self._run_invalid = True
            count, self._run = len(self._run), bytearray()
            return REPLACEMENT_CHAR * count
        return ""

    def _close_run(self) -> str:
        run, self._run = self._run, bytearray()
        self._run_invalid = False
        self._run_check.reset()
        try:
            return run.decode("utf-8")
        except UnicodeDecodeError:
            return REPLACEMENT_CHAR * len(run)  # ended inside a character

    def _strip(self, text: str) -> str:
        while self._strip_left and text:
            if text[0] != " ":
                self._strip_left = 0
                break
            text = text[1:]
            self._strip_left -= 1
        return text


# ---------------------------------------------------------------- fallback: DecodeStream


class StreamDetokenizer:
    """For decoders not modelled above: ``tokenizers.decoders.DecodeStream``.

    DecodeStream decides finality by itself (it holds text ending in U+FFFD), so the exact
    equality with ``tokenizer.decode`` is only as good as its heuristics; ``flush`` decodes
    the ids it is still holding on their own.
    """

    _PRIME_TOKENS = 8  # prompt context fed to the stream (spacing of the first output token)

    def __init__(
        self,
        backend: BackendTokenizer,
        skip_special_tokens: bool,
        prompt_token_ids: Sequence[int] = (),
        spaces_between_special_tokens: bool = True,
    ) -> None:
        from tokenizers.decoders import DecodeStream

        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._held: list[int] = []
        # spaces_between_special_tokens false (vLLM's rule): an added token right after another
        # is its bare content, without the space a decoder (e.g. WordPiece) puts before it.
        self._added: dict[int, str] = {}
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        self._last_added = False
        if prompt_token_ids:
            self.add_tokens(list(prompt_token_ids[-self._PRIME_TOKENS :]))
            self._held.clear()

    @property
    def has_pending(self) -> bool:
        return bool(self._held)

    def add_tokens(self, ids: Sequence[int]) -> str:
        out = []
        for token_id in ids:
            self._held.append(token_id)
            text = self._stream.step(self._backend, token_id)
            if self._added:
                added = self._added.get(token_id)
                if added is not None and self._last_added and text is not None:
                    text = added
                self._last_added = added is not None
            if text is not None:
                out.append(text)
                self._held.clear()
        return "".join(out)

    def flush(self) -> str:
        held, self._held = self._held, []
        if not held:
            return ""
        text: str = self._backend.decode(held, skip_special_tokens=self._skip)
        return text


# ---------------------------------------------------------------- choosing an implementation


def native_enabled() -> bool:
    """The project-wide switch (``TRILLM_NO_EXTENSIONS=1`` forces the Python twin)."""
    from trillm._native import extensions_enabled

    return extensions_enabled()


def load_native_module() -> Any | None:
    """``trillm._ext.detokenizer`` if it was built, else None (ignores the switch)."""
    from trillm._native import native_module

    return native_module("detokenizer")


class DetokenizerFactory:
    """Builds the table once per tokenizer, then one cheap detokenizer per request.

    ``kind`` is "native" (C++), "python" (the twin) or "stream" (DecodeStream fallback).
    """

    def __init__(
        self, tokenizer: Tokenizer | BackendTokenizer, *, native: bool | None = None
    ) -> None:
        self._backend = backend_tokenizer(tokenizer)
        self.spec = build_vocab_spec(tokenizer)
        want_native = native_enabled() if native is None else native
        module = load_native_module() if want_native else None
        if want_native and module is None:
            logger.warning("trillm._ext.detokenizer is not built; using the Python twin.")
        self._vocab: Any = None
        self._detok_class: Any = None
        if self.spec is None:
            self.kind = "stream"
        elif module is not None:
            self.kind = "native"
            self._vocab = module.Vocab(*_spec_args(self.spec))
            self._detok_class = module.IncrementalDetokenizer
        else:
            self.kind = "python"
            self._vocab = PyVocab(*_spec_args(self.spec))
            self._detok_class = PyIncrementalDetokenizer

    def new(
        self,
        skip_special_tokens: bool = True,
        prompt_token_ids: Sequence[int] = (),
        spaces_between_special_tokens: bool = True,
    ) -> Detokenizer:
        if self._detok_class is None:
            return StreamDetokenizer(
                self._backend, skip_special_tokens, prompt_token_ids, spaces_between_special_tokens
            )
        # The modelled decoders concatenate added tokens (never a space between them), so
        # spaces_between_special_tokens gives the same text either way, as in vLLM.
        detokenizer: Detokenizer = self._detok_class(
            self._vocab, skip_special_tokens, list(prompt_token_ids)
        )
        return detokenizer


def _spec_args(spec: VocabSpec) -> tuple[Any, ...]:
    return (
        spec.table,
        spec.special_ids,
        int(spec.scheme),
        spec.byte_token_ids,
        spec.strip_leading_spaces,
        spec.first_table,
    )
